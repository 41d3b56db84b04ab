"""The documentation site builds in strict mode: a broken link or anchor, a page left out of the navigation, a
docstring reference mkdocstrings cannot resolve, or a generator that no longer runs against the code fails here.
The site is built into a temporary directory, so nothing is written into the repository."""

import io
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``mkdocs build --strict`` run in this process (mkdocs' own build function, as its command line calls it): the
    config reference's generator imports the package, which this process has imported already (half of a fresh
    interpreter's build time). Returns (whether it built, what it logged, the site folder)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import MkDocsException

    out = tmp_path_factory.mktemp("site")
    log, handler = io.StringIO(), None
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the configuration's paths (the generator, the griffe extension) are the root's
        # No bytecode beside the docs' scripts; no banners from the theme and plugins about MkDocs' future.
        patch.setattr(sys, "dont_write_bytecode", True)
        patch.setenv("NO_MKDOCS_2_WARNING", "1")
        patch.setenv("DISABLE_MKDOCS_2_WARNING", "true")
        handler = logging.StreamHandler(log)
        logging.getLogger("mkdocs").addHandler(handler)
        config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(out))
        try:
            config.plugins.on_startup(command="build", dirty=False)
            build(config)
            built = True
        except (MkDocsException, SystemExit) as failure:  # strict mode's Abort on a warning, or a plugin's error
            built = False
            log.write(f"\n{type(failure).__name__}: {failure}")
        finally:
            config.plugins.on_shutdown()
            logging.getLogger("mkdocs").removeHandler(handler)
    return built, log.getvalue(), out


def test_site_builds_in_strict_mode(site):
    built, log, _ = site
    assert built, log[-6000:]


def test_generated_config_reference_lists_real_keys(site):
    built, log, out = site
    assert built, log[-6000:]
    page = (out / "reference" / "config" / "index.html").read_text()
    for key in ("checkpoint.trust_deepspeed_checkpoints", "parallel.tensor_parallel_size", "trainer.devices",
                "model.activation_checkpointing", "data.sources[].weight", "recipe=llama3_70b_8node"):
        assert f"{key}" in page, key
