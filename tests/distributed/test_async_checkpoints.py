"""Checkpoints written in the background (``PeriodicCheckpoint(async_save=True)``): training goes on while they are
written, each is published only after every rank's write has finished, a resume from one is bit-identical, and a
failed write is reported with its rank and path. The kills at each stage, through ``mgpu-train``, are in
``tests/cli/test_async_checkpoint_kills.py``."""

import time

import pytest
import torch
from helpers import in_turn
from test_replicas import fit_weights, weight_diff

import lightning as L

from lightning_mgpu.callbacks import PeriodicCheckpoint
from lightning_mgpu.callbacks.checkpoint import CheckpointWriteError
from lightning_mgpu.testing import run_distributed

STEPS = 6


class Boundaries(L.Callback):
    """The time each optimizer step ended, and the published checkpoints seen then (placed before the saver). With
    ``saver``, each boundary first waits until that saver's write in flight has ended (written or failed), so that the
    saver sees its outcome at this boundary however slowly the machine runs."""

    def __init__(self, directory, saver=None) -> None:
        self.directory, self.seen, self.saver = directory, [], saver

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.saver is not None and self.saver.in_flight is not None:
            self.saver.in_flight.wait()
        published = sorted(p.name for p in self.directory.glob("step-*") if not p.name.endswith(".partial"))
        self.seen.append((trainer.global_step, time.time(), published))


def background_fit(rank: int, token_file, directory, slow_rank: int = -1, fail: str = "", ckpt_path=None) -> dict:
    """2 ZeRO-1 ranks saving every 2 steps in the background; ``slow_rank``'s writes take 1.5 s longer (recorded
    when they end); with ``fail``, rank 1's write of step 4 fails: DCP's writing of its tensor files (``write``: a
    full disk) or the checksumming of its share (``checksum``: an unreadable file)."""
    import torch.distributed.checkpoint as dcp

    from lightning_mgpu.checkpoint import background, integrity

    record, write, checksum = background.record_checksums, dcp.FileSystemWriter.write_data, integrity.file_checksum
    ends = []

    def slow_record(path, *args, **kwargs):
        time.sleep(1.5)
        ends.append(time.time())
        return record(path, *args, **kwargs)

    def failing_write(self, plan, planner):
        if "step-00000004" in str(self.path):
            raise OSError(28, "No space left on device")
        return write(self, plan, planner)

    def failing_checksum(path):
        if "step-00000004" in str(path):
            raise OSError(5, "Input/output error")
        return checksum(path)

    if rank == slow_rank:
        background.record_checksums = slow_record
    if rank == 1 and fail:
        if fail == "write":
            dcp.FileSystemWriter.write_data = failing_write
        else:
            integrity.file_checksum = failing_checksum
    saver = PeriodicCheckpoint(directory, every_n_steps=2, async_save=True)
    boundaries = Boundaries(directory, saver if fail else None)
    try:
        out = fit_weights(rank, token_file, 2, max_steps_=STEPS, zero_stage=1, callbacks=(boundaries, saver),
                          ckpt_path=ckpt_path)
    except CheckpointWriteError as error:
        return {"error": str(error), "published": sorted(p.name for p in directory.iterdir()),
                "raised_after": boundaries.seen[-1][0]}
    finally:  # the runs after this one in the same rank write as usual
        background.record_checksums, dcp.FileSystemWriter.write_data = record, write
        integrity.file_checksum = checksum
    return {**out, "seen": boundaries.seen, "write_ends": ends, "blocked_s": saver.blocked_s,
            "in_flight": saver.in_flight}


def synchronous_fit(rank, token_file, directory):
    return fit_weights(rank, token_file, 2, max_steps_=STEPS, zero_stage=1,
                       callbacks=(PeriodicCheckpoint(directory, every_n_steps=2),))


def test_published_only_after_every_rank_has_written_while_training_goes_on(token_file, tmp_path):
    """Rank 1's writes end 1.5 s late: steps go on meanwhile (the checkpoint of step 2 is not published at step 3),
    rank 0 publishes it only after rank 1's write has ended, the end of fit waits for the last one, and the weights
    are those of the run that saved synchronously; resumed from the background checkpoint of step 4, the run ends
    on the same weights, bit for bit. The three runs share one launch."""
    directory = tmp_path / "background"
    calls = {"synchronous": (synchronous_fit, (token_file, tmp_path / "sync"), {}),
             "background": (background_fit, (token_file, directory), dict(slow_rank=1)),
             "published": (lambda rank: torch.distributed.barrier(), (), {}),  # rank 0 has published step 4
             "resumed": (background_fit, (token_file, tmp_path / "again"),
                         dict(ckpt_path=str(directory / "step-00000004")))}
    runs = run_distributed(in_turn, 2, calls)
    synchronous, results, resumed = ([r[name] for r in runs] for name in ("synchronous", "background", "resumed"))
    seen, rank1_ends = results[0]["seen"], results[1]["write_ends"]
    assert len(rank1_ends) == 3 and all(r["in_flight"] is None for r in results)
    first_with_2 = next((step, t) for step, t, published in seen if "step-00000002" in published)
    assert first_with_2[0] >= 4  # steps 3.. trained while the checkpoint of step 2 was written
    assert first_with_2[1] >= rank1_ends[0]  # ... and it appeared only once rank 1 had finished writing it
    # the end waited for 6 (the resumed run wrote elsewhere)
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000004", "step-00000006"]
    for whole, mine in zip(synchronous, results):
        assert mine["losses"] == whole["losses"] and weight_diff(whole["weights"], mine["weights"]) == 0.0
    for whole, again in zip(synchronous, resumed):
        assert again["losses"] == whole["losses"][4:] and weight_diff(whole["weights"], again["weights"]) == 0.0


@pytest.mark.parametrize("fail, said", [("write", "OSError: [Errno 28] No space left on device"),
                                        ("checksum", "not recorded: rank 1: OSError: [Errno 5] Input/output error")])
def test_a_failed_background_write_stops_every_rank_naming_rank_and_path(token_file, tmp_path, fail, said):
    """Rank 1's write of step 4 fails (its tensor files, or the checksums of its share, which every rank then gives
    up together): both ranks stop at the next boundary, after step 5, with one error naming rank 1, the cause and the
    checkpoint; it is not published, and the checkpoint of step 2 is whole. (Each boundary first waits for the write
    in flight to end: the failure is known at the boundary after step 5 however busy the machine is.)"""
    results = run_distributed(background_fit, 2, token_file, tmp_path, fail=fail, timeout=120)
    for r in results:
        assert said in r["error"] and "rank 0:" not in r["error"] and r["raised_after"] == 5, r
        assert "step-00000004.partial" in r["error"]
        assert "step-00000002" in r["published"] and "step-00000004" not in r["published"]


def test_tensor_parallel_pieces_are_assembled_over_each_data_parallel_group(token_file, tmp_path):
    """tp2 x dp2 at ZeRO-2 on 4 ranks: each rank snapshots only its own ZeRO pieces, assembled in the background over
    a twin of its data-parallel group and saved as tensor-parallel shards; resumed from the background checkpoint of
    step 2, the run ends on the weights of the run that wrote it, bit for bit."""
    def fit(rank, token_file, directory, ckpt_path=None):
        saver = PeriodicCheckpoint(directory, every_n_steps=2, async_save=True)
        return fit_weights(rank, token_file, 4, max_steps_=4, zero_stage=2, tensor_parallel_size=2,
                           callbacks=(saver,), ckpt_path=ckpt_path)

    runs = run_distributed(in_turn, 4, {
        "whole": (fit, (token_file, tmp_path / "whole"), {}),
        "again": (fit, (token_file, tmp_path / "again"), dict(ckpt_path=str(tmp_path / "whole" / "step-00000002")))})
    whole, again = [r["whole"] for r in runs], [r["again"] for r in runs]
    for w, a in zip(whole, again):
        assert a["losses"] == w["losses"][2:] and weight_diff(w["weights"], a["weights"]) == 0.0
