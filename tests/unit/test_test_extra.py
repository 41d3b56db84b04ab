"""Every package of the ``test`` extra imports: a missing test dependency fails here, by name, instead of letting the
tests that need it skip silently (the test suite imports its dependencies directly, never through importorskip)."""

import importlib
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: distribution of the ``test`` extra -> the module it installs (the names differ for several)
MODULES = {
    "pytest": "pytest", "pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist", "matplotlib": "matplotlib", "transformers": "transformers",
    "tensorboard": "tensorboard", "wandb": "wandb", "mlflow-skinny": "mlflow", "mkdocs": "mkdocs",
    "mkdocs-material": "material", "mkdocstrings": "mkdocstrings", "mkdocstrings-python": "mkdocstrings_handlers.python",
    "mkdocs-gen-files": "mkdocs_gen_files", "pyarrow": "pyarrow",
    "torchdata": "torchdata", "peft": "peft", "accelerate": "accelerate",
}


def extra_distributions() -> list[str]:
    """The distribution names of pyproject.toml's ``test`` extra."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [Requirement(spec).name for spec in extras["test"]]


def test_every_test_dependency_has_its_module_named():
    assert sorted(extra_distributions()) == sorted(MODULES), "name the module of each new test dependency in MODULES"


@pytest.mark.parametrize("distribution", sorted(MODULES))
def test_every_test_dependency_imports(distribution):
    try:
        importlib.import_module(MODULES[distribution])
    except ImportError as error:
        pytest.fail(f"the test dependency {distribution} does not import ({error}): pip install -e '.[test]'")
