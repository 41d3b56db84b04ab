"""Checksums of every file of a checkpoint, recorded when it is written and verified before it is loaded.

``checksums.json`` beside the files lists each file's size and CRC-32. The ranks share the work: after every rank's
files are written, rank ``r`` checksums every ``world``-th file (largest first), rank 0 writes the list, and only then
is the checkpoint published (renamed into place by the periodic checkpoint). A load verifies the same way, each rank a
share, and every rank gets the whole list of problems, so all of them refuse (or fall back) together.

CRC-32 (``zlib``, about 7 GB/s on one core here) detects bit flips and truncation; it is not a signature. That
checkpoints cannot run code is the loaders' doing (restricted unpickling), not the checksum's.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

CHECKSUMS = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 16 << 20

#: Gathers one picklable value from every rank into a list in rank order (``dist.all_gather_object``, or ``[x]``).
Gather = Callable[[Any], list]


def single_process(value: Any) -> list:
    """The :data:`Gather` of a process that is alone."""
    return [value]


def checkpoint_files(directory: str | Path) -> list[str]:
    """Every file below ``directory`` but the checksum list, as sorted POSIX paths relative to it."""
    root = Path(directory)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def file_checksum(path: str | Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while n := stream.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _share(directory: Path, names: list[str], rank: int, world: int) -> list[str]:
    by_size = sorted(names, key=lambda n: (-(directory / n).stat().st_size, n))
    return by_size[rank::world]


def record_checksums(directory: str | Path, rank: int = 0, world: int = 1, gather: Gather = single_process,
                     failure: Optional[str] = None) -> None:
    """Write ``checksums.json`` for the files in ``directory`` (collective: every rank calls it once its files are
    written; each checksums a share). A rank that fails (an unreadable file, a full disk, or ``failure``: what went
    wrong before, as one line) still takes part in every gather, so that all ranks raise :class:`ChecksumRecordError`
    together instead of leaving the others waiting."""
    directory = Path(directory)
    names = (failure or _attempt(lambda: checkpoint_files(directory))) if rank == 0 else None
    names = gather(names)[0]
    if failure is not None:
        mine = failure
    elif isinstance(names, list):
        mine = _attempt(lambda: {n: {"bytes": (directory / n).stat().st_size, ALGORITHM: file_checksum(directory / n)}
                                 for n in _share(directory, names, rank, world)})
    else:
        mine = names if rank == 0 else None  # rank 0 could not list the files: said once, by rank 0
    parts = gather(mine)
    failed = [f"rank {r}: {part}" for r, part in enumerate(parts) if isinstance(part, str)]
    written = None
    if rank == 0 and not failed:
        entries = {n: e for part in parts for n, e in part.items()}
        written = _attempt(lambda: _write_checksums(directory, entries))
    written = gather(written)[0]  # every rank returns after the list is in place, or raises with the others
    failed += [f"rank 0: {written}"] if isinstance(written, str) else []
    if failed:
        raise ChecksumRecordError(f"checksums of {directory} not recorded: " + "; ".join(failed))


class ChecksumRecordError(OSError):
    """Some rank could not checksum its share of a checkpoint, or rank 0 could not write the list."""


def _attempt(work: Callable[[], Any]) -> Any:
    """``work()``, or its error as a string (what a rank sends the others instead of its result)."""
    try:
        return work()
    except Exception as error:  # noqa: BLE001 - any failure is sent to the others, who raise with it
        return f"{type(error).__name__}: {error}"


def _write_checksums(directory: Path, entries: dict) -> None:
    partial = directory / (CHECKSUMS + ".tmp")
    partial.write_text(json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}, indent=1))
    os.replace(partial, directory / CHECKSUMS)


def recorded_checksums(directory: str | Path) -> tuple[Optional[dict], list[str]]:
    """(``{file: {"bytes", "crc32"}}`` or ``None``, problems reading the list) of the checkpoint ``directory``."""
    directory = Path(directory)
    try:
        recorded = json.loads((directory / CHECKSUMS).read_text())
        files = recorded["files"]
        if recorded.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {recorded.get('algorithm')!r}, expected {ALGORITHM!r}")
        return files, []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, [f"{directory / CHECKSUMS} is unreadable ({type(error).__name__}: {error})"]


def _file_problem(directory: Path, name: str, entry: Any) -> Optional[str]:
    path = directory / name
    try:
        size, expected = int(entry["bytes"]), str(entry[ALGORITHM])
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError("outside the checkpoint")
    except (KeyError, TypeError, ValueError, OverflowError):
        return f"{directory / CHECKSUMS} has a malformed entry for {name}"
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != size:
        return f"{path} has {path.stat().st_size} bytes, {size} were written (truncated or altered)"
    if file_checksum(path) != expected:
        return f"{path} does not match its recorded checksum (its bytes changed after it was written)"
    return None


def _share_problems(directory: Path, files: dict, rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of the recorded ``files`` (rank 0 also reports the missing ones)."""
    names = list(files)
    present = [n for n in names if (directory / n).is_file()]
    mine = _share(directory, present, rank, world)
    if rank == 0:
        mine += [n for n in names if n not in present]
    return [p for n in mine if (p := _file_problem(directory, n, files[n]))]


def checksum_problems(directory: str | Path, rank: int = 0, world: int = 1,
                      gather: Gather = single_process) -> list[str]:
    """Every damaged or missing file of the checkpoint ``directory``, the same list on every rank (collective); an
    empty list when it is intact. A directory without ``checksums.json`` (written before checksums were recorded)
    gives no problems: see :func:`has_checksums`."""
    if not has_checksums(directory):
        return []
    files, problems = recorded_checksums(directory)
    mine = [] if files is None else _share_problems(Path(directory), files, rank, world)
    if rank == 0 and files is not None:  # a file nobody recorded would be read unverified
        mine += [f"{Path(directory) / n} was not written with the checkpoint (it has no recorded checksum)"
                 for n in checkpoint_files(directory) if n not in files]
    return problems + [p for part in gather(mine) for p in part]


def has_checksums(directory: str | Path) -> bool:
    return (Path(directory) / CHECKSUMS).is_file()
