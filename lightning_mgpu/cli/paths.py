"""Where the Hydra configs and recipes are: inside the installed wheel, or at the top of a source checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def conf_dir() -> Path:
    """The ``conf/`` directory (``lightning_mgpu/conf`` in a wheel, ``conf/`` in a checkout)."""
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"lightning_mgpu's Hydra configs were not found next to {_PACKAGE}; reinstall the package")


def recipes_dir() -> Path:
    """The ``recipes/`` directory (``lightning_mgpu/recipes`` in a wheel, ``recipes/`` in a checkout)."""
    for candidate in (_PACKAGE / "recipes", _PACKAGE.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"lightning_mgpu's recipes were not found next to {_PACKAGE}; reinstall the package")
