"""The built-in corpus: the running interpreter's Python standard library source, as byte tokens.

It needs no download and exists wherever Python does. Tokens are bytes (vocabulary 256), written once
to a memory-mapped uint16 token file in the cache directory.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

BYTE_VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3"}


def cache_dir() -> Path:
    """Where derived token files live: ``$MGPU_CACHE_DIR`` or ``~/.cache/lightning_mgpu``."""
    return Path(os.environ.get("MGPU_CACHE_DIR", Path.home() / ".cache" / "lightning_mgpu"))


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files, in a fixed order (test suites and third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no Python source files found under the standard library at {root}")
    return files


def encode_bytes(text: bytes | str) -> np.ndarray:
    """Byte-level tokens of ``text`` (uint16)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens) -> str:
    """Text of byte-level tokens (undecodable bytes are replaced)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def write_token_file(path: Path, chunks) -> Path:
    """Write uint16 token ``chunks`` to ``path`` atomically (safe when several ranks build it at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(np.asarray(chunk, dtype=np.uint16).tobytes())
    os.replace(tmp, path)
    return path


def stdlib_token_file(directory: Path | None = None) -> Path:
    """Path of the built-in corpus token file (uint16), building it on first use."""
    import platform

    name = f"stdlib-py{platform.python_version()}-bytes.u16"
    path = (directory or cache_dir()) / name
    if not path.exists():
        write_token_file(path, (encode_bytes(f.read_bytes() + b"\n") for f in stdlib_source_files()))
    return path
