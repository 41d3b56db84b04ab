"""Reading ``torch.distributed.checkpoint`` directories without running code from them.

DCP's own ``FileSystemReader.read_metadata`` reads ``.metadata`` with a plain ``pickle.load``: a ``.metadata`` file
whose pickle names any importable callable runs it while the checkpoint is opened. This reader unpickles it with an
allow-list of the types DCP writes there (its metadata dataclasses and ``_StorageInfo``, ``torch.Size``, dtypes,
layouts by name, memory formats, an ``OrderedDict``, a path) and refuses anything else before constructing it. It
also refuses a pickle's BUILD (setting attributes) on anything but an instance of those dataclasses with their own
fields, which would otherwise let an allowed name be rewritten for the whole process (``PosixPath.exists = ...``).
Byte entries (``BytesStorageMetadata``) are refused: DCP loads them with ``torch.load(weights_only=False)``, and this
package never writes them. Storage entries must name a file of the checkpoint directory itself (no path separator),
so the checksums cover every file DCP reads. Tensor data is read by DCP with ``torch.load(weights_only=True)``.

Hand-written because torch offers no restricted reader for DCP metadata (``torch.serialization.add_safe_globals``
governs ``torch.load`` only, and ``.metadata`` is a bare pickle); it builds on the pure-Python ``pickle._Unpickler``,
whose opcode table can be restricted (the C unpickler's BUILD cannot), at no cost that matters for a metadata file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
#: (module, name) pairs DCP's ``.metadata`` pickle may name; each builds plain data and runs nothing else.
_ALLOWED = frozenset({
    *((_METADATA_MODULE, name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
        "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})
#: torch attributes that are plain values (dtypes, layouts, memory formats), admitted by name.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names a type that loading it would construct (and so could run code): refused."""


#: The types whose instances a BUILD may fill, each with its own fields (or its own ``__setstate__``).
_BUILDABLE_NAMES = ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
                    "StorageMeta")


_BUILDABLE = tuple(getattr(dcp_metadata, name) for name in _BUILDABLE_NAMES) + (_StorageInfo,)


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the pure-Python unpickler, see above
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path
        self.dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _MetadataUnpickler._build}  # type: ignore

    def _build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        fields = getattr(type(target), "__dataclass_fields__", {})
        plain = isinstance(state, dict) and set(state) <= set(fields)
        own = isinstance(state, tuple) and "__setstate__" in vars(type(target))
        if not (isinstance(target, _BUILDABLE) and (plain or own)):
            raise UnsafeCheckpointError(
                f"{self.path} sets attributes of a {type(target).__name__} ({target!r:.80}) while it loads: refused "
                "(a checkpoint's metadata only fills the fields of its own records). The file was not written by "
                "lightning_mgpu's universal format or has been altered; do not load it")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        reason = ("byte entries are loaded by unrestricted unpickling and this package never writes them"
                  if name == "BytesStorageMetadata" else "it is not one of the checkpoint metadata types")
        raise UnsafeCheckpointError(
            f"{self.path} names {module}.{name}, which loading would construct: refused ({reason}). The file was "
            "not written by lightning_mgpu's universal format or has been altered; do not load it")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The ``Metadata`` of the DCP directory ``path`` (or of the ``.metadata`` file itself), read without running
    any code from it; :class:`UnsafeCheckpointError` names the file and the type when it holds anything else."""
    path = Path(path)
    file = path / ".metadata" if path.is_dir() else path
    with open(file, "rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream, file).load()
        except UnsafeCheckpointError:
            raise
        except Exception as error:  # truncated or garbled: not a pickle of the admitted types
            raise UnsafeCheckpointError(f"{file} is not readable checkpoint metadata ({type(error).__name__}: "
                                        f"{error}); the checkpoint is damaged") from error
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file} holds a {type(metadata).__name__}, not checkpoint metadata: refused")
    outside = sorted({str(info.relative_path) for info in (metadata.storage_data or {}).values()
                      if not _is_plain_name(getattr(info, "relative_path", None))})
    if outside:
        raise UnsafeCheckpointError(f"{file} points DCP at files outside its directory ({', '.join(outside[:3])}): "
                                    "refused; a checkpoint's tensor files sit beside its .metadata")
    return metadata


def _is_plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata`; ``metadata``: what that function
    already returned for this directory (its pure-Python unpickling is a restore's largest CPU cost on a small model:
    read once)."""

    def __init__(self, path: str | Path, metadata: Optional[Metadata] = None) -> None:
        super().__init__(path)
        self._read = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self._read if self._read is not None and rank is None else \
            read_dcp_metadata(Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
