"""The documentation site builds in strict mode: a broken link or anchor, a page left out of the navigation, a
docstring reference mkdocstrings cannot resolve, or a generator that no longer runs against the code fails here.
The site is built into a temporary directory, so nothing is written into the repository."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    # No bytecode beside the docs' scripts; no banners from the theme and plugins about MkDocs' future.
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    return proc, out


def test_site_builds_in_strict_mode(site):
    proc, _ = site
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def test_generated_config_reference_lists_real_keys(site):
    proc, out = site
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    page = (out / "reference" / "config" / "index.html").read_text()
    for key in ("checkpoint.trust_deepspeed_checkpoints", "parallel.tensor_parallel_size", "trainer.devices",
                "model.activation_checkpointing", "data.sources[].weight", "recipe=llama3_70b_8node"):
        assert f"{key}" in page, key
