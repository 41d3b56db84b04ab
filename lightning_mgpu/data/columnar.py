"""Parquet files and Hugging Face ``datasets`` saved to disk (Arrow) as inputs of ``mgpu-prepare``: one text column.

Read with pyarrow alone (the optional extra ``lightning_mgpu[parquet]``), imported only when such an input is given:

- a Parquet file (``.parquet``, ``.pq``): every row group, in order; one row is one document;
- an Arrow file (``.arrow``): the Arrow IPC stream format that ``datasets`` writes (the IPC file format too);
- a directory written by ``datasets.Dataset.save_to_disk``: ``state.json`` lists its ``data-*.arrow`` shards in order
  (``dataset_info.json`` beside it is not needed); a ``DatasetDict`` directory (``dataset_dict.json``, one
  subdirectory per split) is read through the split that ``--split`` names.

Every input's schema is checked before anything is tokenised (:func:`schema_problems`): a file that is not Parquet /
Arrow, a missing column (naming the columns there are) or a column that is not text. The main process then reads the
column batch by batch (a Parquet file row group by row group, an Arrow file memory-mapped) and cuts it into
:class:`TextColumn` units of about ``unit_bytes`` of text, which the tokenising processes turn back into strings:
the units, not the row groups, are the work shared out, so a file written as one huge row group (pyarrow writes up to
1Mi rows in one) is tokenised by every process all the same, and memory stays bounded by the units read ahead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow",)
DATASET_STATE = "state.json"  #: in a directory written by ``Dataset.save_to_disk``: its shards, in order
DATASET_DICT = "dataset_dict.json"  #: in a directory written by ``DatasetDict.save_to_disk``: its splits
INSTALL_HINT = "pip install 'lightning_mgpu[parquet]' (pyarrow)"
#: Rows read from a Parquet file at a time (then cut into units by their bytes of text).
PARQUET_BATCH_ROWS = 1024
_FIX_KEY = "set --text-key to the column with the text"


def is_parquet(path: Path) -> bool:
    return path.name.lower().endswith(PARQUET_SUFFIXES)


def is_arrow(path: Path) -> bool:
    return path.name.lower().endswith(ARROW_SUFFIXES)


def is_columnar(path: Path) -> bool:
    """A Parquet or Arrow input file: its rows are documents, their text one column."""
    return is_parquet(path) or is_arrow(path)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``)."""
    return path.is_dir() and ((path / DATASET_STATE).is_file() or (path / DATASET_DICT).is_file())


def dataset_splits(directory: Path) -> Optional[list[str]]:
    """The splits of a ``DatasetDict`` directory, or None for a ``Dataset`` directory."""
    if not (directory / DATASET_DICT).is_file():
        return None
    try:
        splits = json.loads((directory / DATASET_DICT).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ColumnarError([f"{directory / DATASET_DICT} cannot be read as a DatasetDict's list of splits ({err})"]) \
            from None
    return [str(s) for s in splits]


class ColumnarError(ValueError):
    """Inputs that cannot be read as Parquet / Arrow / saved datasets, every problem one line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def dataset_files(directory: Path, split: Optional[str]) -> list[Path]:
    """The Arrow shards of a saved dataset directory, in its order: those its ``state.json`` lists, of the split
    ``split`` for a ``DatasetDict`` directory (which needs one)."""
    splits = dataset_splits(directory)
    if splits is not None:
        if split is None:
            raise ColumnarError([f"{directory} is a DatasetDict with the splits {', '.join(splits)}; choose one with "
                                 f"--split (e.g. --split {splits[0] if splits else 'train'})"])
        if split not in splits:
            raise ColumnarError([f"{directory} has no split {split!r} (its splits: {', '.join(splits)}); set --split "
                                 "to one of them"])
        directory = directory / split
        if not (directory / DATASET_STATE).is_file():
            raise ColumnarError([f"{directory} has no {DATASET_STATE}: not a dataset written by save_to_disk"])
    state = directory / DATASET_STATE
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ColumnarError([f"{state} cannot be read as a saved dataset's list of Arrow files ({err})"]) from None
    files = [directory / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ColumnarError([f"{state} lists {', '.join(missing)}, missing from {directory}: the dataset is "
                             "incomplete; save it again"])
    return files


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return None
    return pyarrow


def _is_text(pa, dtype) -> bool:
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(dtype))


def _open_arrow(pa, path: Path):
    """A reader of the record batches of an Arrow IPC stream (what ``datasets`` writes) or IPC file, memory-mapped.
    The caller closes the memory map (``reader[1]``)."""
    source = pa.memory_map(str(path), "r")
    try:
        if source.read(6) == b"ARROW1":  # the IPC file format's magic; a stream begins with a message length
            source.seek(0)
            file = pa.ipc.open_file(source)
            return file.schema, source, (file.get_batch(i) for i in range(file.num_record_batches))
        source.seek(0)
        stream = pa.ipc.open_stream(source)
        return stream.schema, source, stream
    except BaseException:
        source.close()
        raise


def schema_problems(files: Sequence[Path], text_key: str) -> list[str]:
    """What keeps each Parquet / Arrow file of ``files`` from being read for its ``text_key`` column, all at once
    (only the footers and schemas are read)."""
    columnar = [f for f in files if is_columnar(f)]
    if not columnar:
        return []
    pa = _pyarrow()
    if pa is None:
        return [f"{columnar[0]}{f' and {len(columnar) - 1} more Parquet/Arrow file(s)' if len(columnar) > 1 else ''}: "
                f"reading Parquet and Arrow needs pyarrow, which is not installed; {INSTALL_HINT}"]
    problems = []
    for path in columnar:
        kind = "Parquet" if is_parquet(path) else "Arrow"
        try:
            if is_parquet(path):
                with pa.parquet.ParquetFile(str(path)) as f:
                    schema = f.schema_arrow
            else:
                schema, source, _ = _open_arrow(pa, path)
                source.close()
        except (OSError, pa.ArrowException) as err:
            problems.append(f"{path}: not a readable {kind} file ({_first_line(err)})")
            continue
        if text_key not in schema.names:
            names = schema.names
            listed = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            problems.append(f"{path}: no column {text_key!r} (its columns: {listed or 'none'}); {_FIX_KEY}")
        elif not _is_text(pa, schema.field(text_key).type):
            problems.append(f"{path}: column {text_key!r} is of type {schema.field(text_key).type}, not text (string); "
                            f"{_FIX_KEY}")
    return problems


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@dataclass(frozen=True)
class TextColumn:
    """Rows ``first_row ..`` of one file's text column: UTF-8 ``data`` cut at ``offsets`` (one more than the rows)."""

    first_row: int
    offsets: np.ndarray
    data: bytes

    @property
    def text_bytes(self) -> int:
        return len(self.data)

    def texts(self, path: str) -> tuple[list[str], list[str]]:
        """(the rows' texts, what is wrong with the others)."""
        out, problems = [], []
        data, offsets = self.data, self.offsets.tolist()
        for i in range(len(offsets) - 1):
            raw = data[offsets[i]:offsets[i + 1]]
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                problems.append(f"{path}: row {self.first_row + i}: not UTF-8 text (byte {err.start} is "
                                f"{raw[err.start]:#04x}); convert it to UTF-8")
        return out, problems


def _offsets(array) -> np.ndarray:
    """The ``len(array) + 1`` byte offsets of a ``large_string`` array's rows in its data buffer: the array's own
    slice of the offsets buffer, which a sliced array shares with the whole."""
    return np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset:array.offset + len(array) + 1]


def _text_column(array, first_row: int) -> TextColumn:
    """A :class:`TextColumn` of a non-null ``large_string`` array (its own slice of the buffers, not all of them)."""
    data_buffer = array.buffers()[2]
    offsets = _offsets(array)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = data_buffer.slice(start, stop - start).to_pybytes() if data_buffer is not None and stop > start else b""
    return TextColumn(first_row, offsets - start, data)


def _batches(pa, path: Path, text_key: str):
    """(the text column of each record batch of ``path``, in row order; something to close at the end)."""
    if is_parquet(path):
        f = pa.parquet.ParquetFile(str(path))
        batches = f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key], use_threads=False)
        return (b.column(0) for b in batches), f
    _, source, batches = _open_arrow(pa, path)
    return (b.column(text_key) for b in batches), source


def _large_text(pa, column, first_row: int) -> tuple[Any, int, Optional[int]]:
    """(``column`` as a non-null ``large_string`` array, its null rows, the file row of its first null or None).

    A null row becomes empty text, so that the rows around it are still read and every null of a file is counted
    (the file is then refused once, naming the first); ``large_string``'s int64 offsets cut units of any size."""
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    nulls, first_null = column.null_count, None
    if nulls:
        first_null = first_row + pc.index(pc.is_null(column), True).as_py()
        column = pc.fill_null(column, "")
    return column.cast(pa.large_string()), nulls, first_null


def read_columnar(path: Path, text_key: str, unit_bytes: int) -> Iterator[tuple[Optional[TextColumn], list[str]]]:
    """(:class:`TextColumn` of about ``unit_bytes`` of text, read errors) of ``path``'s ``text_key`` column, in
    order (a unit never spans files). Null rows are counted and named once at the end of the file; a file that
    cannot be read further ends with its error."""
    pa = _pyarrow()
    pending, pending_bytes, pending_first, row = [], 0, 0, 0
    nulls, first_null = 0, None

    def unit():
        joined = pending[0] if len(pending) == 1 else pa.concat_arrays(pending)
        return _text_column(joined, pending_first), []

    try:
        batches, closing = _batches(pa, path, text_key)
        with closing:
            for column in batches:
                column, column_nulls, column_first_null = _large_text(pa, column, row)
                nulls += column_nulls
                first_null = column_first_null if first_null is None else first_null
                offsets = _offsets(column)
                start = 0
                while start < len(column):
                    # the first row at which the pending text reaches unit_bytes ends the unit
                    need = int(offsets[start]) + unit_bytes - pending_bytes
                    end = int(np.searchsorted(offsets[start + 1:], need, side="left")) + start + 1
                    if not pending:
                        pending_first = row + start
                    piece_end = min(end, len(column))
                    pending.append(column.slice(start, piece_end - start))
                    pending_bytes += int(offsets[piece_end] - offsets[start])
                    start = piece_end
                    if pending_bytes >= unit_bytes:
                        yield unit()
                        pending, pending_bytes = [], 0
                row += len(column)
    except (OSError, pa.ArrowException) as err:
        if pending:
            yield unit()
        yield None, [f"{path}: cannot be read from row {row} on ({_first_line(err)})"]
        return
    if pending:
        yield unit()
    if nulls:
        yield None, [f"{path}: row {first_null}: column {text_key!r} is null (in {nulls:,} row(s) of this file); drop "
                     "or fill those rows"]


__all__ = ["ColumnarError", "TextColumn", "dataset_files", "dataset_splits", "is_arrow", "is_columnar", "is_parquet",
           "is_saved_dataset", "read_columnar", "schema_problems"]
