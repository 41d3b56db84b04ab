"""DualPipeV's forward / backward pairs overlapped on two threads give the sequential schedule's numbers: the package's
mixture of experts at expert parallel 2 x pipeline parallel 2 (4 ranks), trained once with torch's sequential pairs
and once overlapped, in one launch.

Broken once each (2026-12-06): the backward's send issued before the forward's (losses 0.052 apart: the receiving rank
took an activation for a gradient, both of one shape); the backward run after the forward on the schedule's thread
(the thread check failed). Without the twin groups the ranks died of SIGABRT in gloo."""

import threading
from dataclasses import replace

import lightning as L
from helpers import GLOBAL_BATCH, OPTIM, fit
from moe_helpers import TINY_MOE

from lightning_mgpu import LLMModule
from lightning_mgpu.testing import run_distributed

STEPS = 3
#: Four layers (the first dense), so each of the four stages holds one; both balancing losses and the bias on.
MODEL = replace(TINY_MOE, n_layers=4, dense_layers=1, router_bias_rate=0.01)
LAYOUT = dict(expert_parallel_size=2, pipeline_parallel_size=2, zero_stage=1, pipeline_schedule="dualpipev",
              virtual_pipeline_size=2)


class Overlap(L.Callback):
    """Turns the overlap on or off before the first step, and records what it did."""

    def __init__(self, on: bool) -> None:
        self.on, self.out = on, {}

    def on_train_start(self, trainer, module) -> None:
        overlap = trainer.strategy.pipeline.overlap
        self.out.update(built=overlap is not None, by_default=overlap is not None and overlap.enabled,
                        wirings=len(overlap.wirings) if overlap is not None else 0)
        if overlap is not None:
            overlap.enable(self.on)

    def on_train_end(self, trainer, module) -> None:
        overlap = trainer.strategy.pipeline.overlap
        self.out.update(pairs=overlap.overlapped, backward_threads=sorted(overlap.backward_threads),
                        schedule_thread=threading.get_ident())


def both_ways(rank, token_file, devices):
    runs = {}
    for on in (False, True):
        callback = Overlap(on)
        module = LLMModule(MODEL, **OPTIM, global_batch_size=GLOBAL_BATCH)
        result = fit(rank, token_file, devices, max_steps=STEPS, module=module, callbacks=[callback],
                     check_layout=False, data=dict(micro_batch_size=1), **LAYOUT)
        runs[on] = {**result, **callback.out}
    return runs


def test_overlapped_pairs_equal_the_sequential_schedule(token_file):
    results = run_distributed(both_ways, 4, token_file, 4)
    for r in results:
        sequential, overlapped = r[False], r[True]
        assert sequential["built"] and overlapped["built"]  # it applies to this layout
        assert not sequential["by_default"]  # off by default on CPU, where it costs time
        # layer l on stage l; pipeline rank 0 holds stages 0 (dense) and 3, rank 1 stages 1 and 2: all set to twin
        assert overlapped["wirings"] == (1 if overlapped["rank"] % 2 == 0 else 2), overlapped
        assert sequential["pairs"] == 0
        # at least one pair a step on every rank (8 micro-batches over 4 stages)
        assert overlapped["pairs"] >= STEPS, overlapped["pairs"]
        threads = overlapped["backward_threads"]
        assert threads and overlapped["schedule_thread"] not in threads  # the backward ran beside, not after
        for key in ("losses", "grad_norms"):
            assert len(overlapped[key]) == STEPS
            diff = max(abs(a - b) for a, b in zip(overlapped[key], sequential[key]))
            assert diff <= 1e-6, (key, sequential[key], overlapped[key])
