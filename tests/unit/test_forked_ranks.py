"""The multi-process test harness (``lightning_mgpu.testing.run_distributed``): a rank that dies of a fatal signal is
reported with its own stacks, and one crash is launched once more, with a warning that carries them; each rank
works in its launch's temporary directory."""

import faulthandler
import os
import signal
from pathlib import Path

import pytest

from lightning_mgpu.testing import RankCrashed, run_distributed


def _crash_in_a_named_frame(rank: int, marker: str, crashes: int) -> int:
    """Rank 1 sends itself SIGSEGV while ``marker`` holds fewer than ``crashes`` lines (one added per crash)."""
    if rank == 1 and len(Path(marker).read_text().splitlines()) < crashes:
        with open(marker, "a") as f:
            f.write("crashed\n")
        _this_frame_crashes()
    return rank * 10


def _this_frame_crashes() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.fixture(autouse=True)
def a_library_took_sigsegv_after_faulthandler():
    """What a test session meets: pytest enabled faulthandler, then a library installed its own SIGSEGV disposition
    (the forked ranks inherit it); faulthandler's handler is put back afterwards."""
    faulthandler.enable()
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    yield
    faulthandler.disable()
    faulthandler.enable()


def test_one_crash_is_launched_again_with_a_warning_that_holds_its_stacks(tmp_path):
    marker = tmp_path / "crashes"
    marker.write_text("")
    with pytest.warns(RuntimeWarning) as warned:
        assert run_distributed(_crash_in_a_named_frame, 2, str(marker), 1) == [0, 10]
    message = str(warned[0].message)
    assert "rank 1 of _crash_in_a_named_frame on 2 processes died of SIGSEGV" in message
    assert "_this_frame_crashes" in message and "launched _crash_in_a_named_frame once more" in message
    assert len(marker.read_text().splitlines()) == 1


def test_a_second_crash_raises_with_the_stacks_of_the_rank_that_died(tmp_path):
    marker = tmp_path / "crashes"
    marker.write_text("")
    with pytest.warns(RuntimeWarning), pytest.raises(RankCrashed, match="(?s)died of SIGSEGV.*_this_frame_crashes"):
        run_distributed(_crash_in_a_named_frame, 2, str(marker), 2)
    assert len(marker.read_text().splitlines()) == 2


def test_a_crash_is_fatal_where_faulthandler_would_re_raise_it_under_a_librarys_python_handler(tmp_path):
    """faulthandler, after its dump, re-raises a fatal signal under the handler it found when last enabled in the test
    session; a library's Python-level SIGSEGV handler found there would let the rank go on (CI once saw "DID NOT RAISE"
    above). Without the rank resetting the fatal signals to their default: this fails the same way."""
    faulthandler.disable()
    signal.signal(signal.SIGSEGV, lambda *_: None)
    faulthandler.enable()
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    marker = tmp_path / "crashes"
    marker.write_text("")
    try:
        with pytest.warns(RuntimeWarning), pytest.raises(RankCrashed, match="died of SIGSEGV"):
            run_distributed(_crash_in_a_named_frame, 2, str(marker), 2)
    finally:  # the session's faulthandler goes back to re-raising under the default disposition
        faulthandler.disable()
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        faulthandler.enable()


def _report_where_it_stands(rank: int) -> str:
    """What a Trainer without a default_root_dir does when a peer fails: a hang report in the working directory."""
    Path(f"hang-rank{rank}-collectives.json").write_text("{}")
    return os.getcwd()


def test_what_a_rank_writes_in_its_working_directory_goes_with_its_launch(tmp_path, monkeypatch):
    """Each rank works in its launch's temporary directory, removed with it: reports a test's ranks write relative to
    the working directory never land where the test session stands (the repository)."""
    monkeypatch.chdir(tmp_path)
    places = run_distributed(_report_where_it_stands, 2)
    assert list(tmp_path.iterdir()) == [] and not any(Path(p).exists() for p in places), places
