"""Resume on another layout: one chain of runs, each layout resuming the universal checkpoint the previous one wrote
(every two steps, by ``PeriodicCheckpoint`` as ``mgpu-train`` writes them), training two more steps and saving for
the next. Every segment matches the uninterrupted single-process run to 1e-5 in loss and gradient norm, and its
counters (global step, ``tokens_seen``, the learning rate of each step) continue exactly where the run left off, and
each step's global batch (its token windows over every rank) is the one the uninterrupted run draws, whether the
number of data-parallel ranks grew (1 -> 2, 1 -> 4) or shrank (2 -> 1) at the resume.

A chain needs one launch per layout where independent save/resume pairs need two per target layout. Every segment
after the first is a resume target: pp2 1F1B -> pp2 interleaved (V=2) ZeRO-3 with one replica -> dp2 -> tp2 ZeRO-3
with one replica -> tp2 x dp2 ZeRO-2 -> one process -> cp2 ZeRO-3 (context parallel) -> pp2 x tp2 + SP -> dp4
ZeRO-3."""

from dataclasses import replace

import lightning as L
import pytest
from helpers import GLOBAL_BATCH, OPTIM, SEQ_LEN, TINY, assert_parity, fit, global_batches, reference

from lightning_mgpu import LLMModule
from lightning_mgpu.callbacks import PeriodicCheckpoint, newest_checkpoint
from lightning_mgpu.testing import run_distributed

MODEL = replace(TINY, n_layers=4)  # four blocks: enough for pp2 with two interleaved stages per rank
STEPS = 2  # per segment
CHAIN = [
    dict(devices=2, pipeline_parallel_size=2),  # 1F1B
    dict(devices=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2,
         zero_stage=3),  # ZeRO-3 with one data-parallel replica, pipelined
    dict(devices=2, zero_stage=2),
    dict(devices=2, tensor_parallel_size=2, zero_stage=3),  # ZeRO-3 with one data-parallel replica, tp > 1
    dict(devices=4, tensor_parallel_size=2, zero_stage=2),
    dict(devices=1),
    dict(devices=2, context_parallel_size=2, zero_stage=3),  # sequences split: ZeRO over the context ranks
    dict(devices=4, pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True, zero_stage=1),
    dict(devices=4, zero_stage=3),
]
OPTIMIZER = dict(OPTIM, max_steps=STEPS * len(CHAIN))  # the LR changes at every step of the chain


def describe(layout: dict) -> str:
    return "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


class Counters(L.Callback):
    """Per step: the LR the step trains with (read as it starts), then the global step and ``tokens_seen`` after it;
    and the token windows of this rank's share of the step's global batch."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []
        self.batches: list[list[tuple[int, ...]]] = []
        self._lr = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.batches.append([tuple(row) for row in batch.tolist()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append((trainer.global_step, pl_module.tokens_seen, self._lr))


def segment(rank, token_file, devices, directory, max_steps, ckpt_path, **layout):
    counters = Counters()
    module = LLMModule(MODEL, **OPTIMIZER, global_batch_size=GLOBAL_BATCH)
    result = fit(rank, token_file, devices, max_steps=max_steps, ckpt_path=ckpt_path, module=module,
                 callbacks=[counters, PeriodicCheckpoint(directory, every_n_steps=STEPS, keep_last=1)], **layout)
    return dict(result, counters=counters.rows, batches=counters.batches)


class Chain:
    """Runs the segments in order, once, as the tests ask for them."""

    def __init__(self, token_file, directory) -> None:
        self.token_file, self.directory = token_file, directory
        self.results: list = []

    def __getitem__(self, index: int) -> list[dict]:
        while len(self.results) <= index:
            failed = [i for i, r in enumerate(self.results) if isinstance(r, BaseException)]
            if failed:
                raise RuntimeError(f"segment {failed[0]} ({describe(CHAIN[failed[0]])}) failed: nothing to resume from")
            self.results.append(self._run(len(self.results)))
        if isinstance(self.results[index], BaseException):
            raise self.results[index]
        return self.results[index]

    def _run(self, i: int):
        layout = dict(CHAIN[i])
        devices = layout.pop("devices")
        resume = newest_checkpoint(self.directory)
        try:
            assert (resume.name if resume else None) == (f"step-{i * STEPS:08d}" if i else None), resume
            return run_distributed(segment, devices, self.token_file, devices, self.directory, (i + 1) * STEPS,
                                   None if resume is None else str(resume), **layout)
        except Exception as error:  # kept, so that the later segments report that they have nothing to resume from
            return error


@pytest.fixture(scope="module")
def chain(token_file, tmp_path_factory):
    return Chain(token_file, tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="module")
def ref(token_file):
    steps = STEPS * len(CHAIN)
    out = reference(token_file, steps=steps, clip=0.3, model=MODEL, optim=OPTIMIZER)
    # The LR each step of the uninterrupted run trains with, from the module's own optimizer and schedule.
    module = LLMModule(MODEL, **OPTIMIZER, global_batch_size=GLOBAL_BATCH)
    module.configure_model()
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    out["batches"] = [sorted(set(map(tuple, b.tolist()))) for b in global_batches(token_file, steps)]
    out["lrs"] = []
    for _ in range(steps):
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


@pytest.mark.parametrize("index", range(len(CHAIN)),
                         ids=["new->" + describe(CHAIN[0])] +
                             [f"{describe(a)}->{describe(b)}" for a, b in zip(CHAIN, CHAIN[1:])])
def test_resume_on_another_layout_continues_the_run(chain, ref, index):
    results = chain[index]
    steps = range(index * STEPS, (index + 1) * STEPS)
    assert_parity(results, {k: [ref[k][s] for s in steps] for k in ("losses", "grad_norms")})
    expected = [(s + 1, (s + 1) * GLOBAL_BATCH * SEQ_LEN, ref["lrs"][s]) for s in steps]
    for r in results:
        assert [row[:2] for row in r["counters"]] == [row[:2] for row in expected], \
            f"rank {r['rank']}: (global step, tokens_seen) {r['counters']}, uninterrupted {expected}"
        assert [row[2] for row in r["counters"]] == pytest.approx([row[2] for row in expected], rel=1e-12, abs=0)
    # the global batches the uninterrupted run draws, whatever the number of data-parallel ranks before and after:
    # each step's windows over every rank (tensor, context and pipeline peers hold the same share) are those batches
    for i, s in enumerate(steps):
        seen = sorted({row for r in results for row in r["batches"][i]})
        assert seen == ref["batches"][s], f"step {s}: the ranks drew other windows than the uninterrupted run's"
