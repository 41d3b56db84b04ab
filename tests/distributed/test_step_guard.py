"""A step whose loss is NaN on one rank, a thousand times too large on one rank (from the first steps: the cross-rank
rule needs no history), or a thousand times too large on every rank (the history rule) is skipped on every rank: a
plain LightningModule's final weights equal, bit for bit, those of a run that never saw that batch (Adam's step count,
its moments and a per-step LR schedule included), at ZeRO 0, 1 and 3; the warning names the step, the rank and the
values."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from test_lightning_conformance import LogLines

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.engine.runtime import gathered
from lightning_mgpu.resilience import SpikeRule
from lightning_mgpu.testing import run_distributed

STEPS, BAD_STEP, BAD_RANK = 8, 5, 1  # step 5 counted from 0 (as metrics.csv): 5 steps of history before it
EARLY_STEP = 2  # 2 steps of history, fewer than RULE's min_history: only the cross-rank rule can see a spike there
RULE = dict(window=8, sigmas=6.0, min_history=3, min_rise=0.5)


class StepBatches(Dataset):
    """Item i: this rank's batch of step i (16 points of 4 Gaussian classes), seeded by rank and step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + step)
        y = torch.randint(0, 4, (16,), generator=g)
        return torch.randn(16, 8, generator=g) + y[:, None].float(), y


class Classifier(L.LightningModule):
    """Two linear layers under Adam and a per-step decaying LR; ``fault`` = (step, rank, "nan" | "x1000") spoils that
    rank's loss at that step (rank None: every rank's)."""

    def __init__(self, steps: list[int], fault: Optional[tuple[int, int, str]] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.steps, self.fault = steps, fault

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        step, rank, kind = self.fault or (None, None, None)
        if self.trainer.global_step == step and rank in (self.global_rank, None):
            loss = loss * math.nan if kind == "nan" else loss * 1000
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepBatches(self.global_rank), batch_size=None, sampler=self.steps)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def weights_after(stage: int, steps: list[int], fault: Optional[tuple[int, int, str]] = None) -> dict:
    module = Classifier(steps, fault)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=len(steps), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        use_distributed_sampler=False, limit_val_batches=0,
                        strategy=MGPUStrategy(zero_stage=stage, loss_spike=SpikeRule(**RULE)))
    with LogLines() as log:
        trainer.fit(module)
    with gathered(list(module.parameters())):
        weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    return {"weights": weights, "skipped": [(s.step, s.ranks) for s in trainer.strategy.skipped_steps],
            "warned": [line for line in log.lines if "skipped on every rank" in line]}


def five_runs(rank: int, stage: int) -> dict:
    """The run that never sees the bad step's batch, then the runs where one rank's loss is NaN, or every rank's x1000,
    there; the run that never sees the early step's batch, and the run where one rank's loss is x1000 there."""
    every = list(range(STEPS))
    return {"reference": weights_after(stage, [s for s in every if s != BAD_STEP]),
            "nan": weights_after(stage, every, (BAD_STEP, BAD_RANK, "nan")),
            "x1000": weights_after(stage, every, (BAD_STEP, None, "x1000")),
            "early_reference": weights_after(stage, [s for s in every if s != EARLY_STEP]),
            "early_x1000": weights_after(stage, every, (EARLY_STEP, BAD_RANK, "x1000"))}


STAGES = [0, 1, 3]


@pytest.fixture(scope="module")
def every_stage():
    """Each stage's five runs, all in one launch of 2 ranks: stage -> each rank's runs."""
    results = run_distributed(lambda rank: {stage: five_runs(rank, stage) for stage in STAGES}, 2)
    return {stage: [r[stage] for r in results] for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_a_bad_step_is_skipped_as_if_its_batch_was_never_seen(every_stage, stage):
    results = every_stage[stage]
    for rank, runs in enumerate(results):
        assert runs["reference"]["skipped"] == [] and runs["early_reference"]["skipped"] == []
        for kind, reference in (("nan", "reference"), ("x1000", "reference"), ("early_x1000", "early_reference")):
            run = runs[kind]
            for name, expected in runs[reference]["weights"].items():
                assert torch.equal(run["weights"][name], expected), (stage, kind, rank, name)
                assert torch.isfinite(run["weights"][name]).all()
        assert runs["nan"]["skipped"] == [(BAD_STEP, (BAD_RANK,))]  # named: the rank whose loss was not finite
        assert runs["x1000"]["skipped"] == [(BAD_STEP, ())]  # a spike of the mean loss: no rank to blame alone
        assert runs["early_x1000"]["skipped"] == [(EARLY_STEP, (BAD_RANK,))]  # far above the other rank's loss
    warned = results[0]["nan"]["warned"]
    assert len(warned) == 1 and warned[0].startswith(f"step {BAD_STEP} skipped on every rank: the loss was not finite "
                                                     f"on rank(s) [{BAD_RANK}]"), warned
    spike = results[0]["x1000"]["warned"]
    assert len(spike) == 1 and spike[0].startswith(f"step {BAD_STEP} skipped on every rank: the loss ") and \
        "standard deviations above the mean" in spike[0] and "highest" in spike[0] and "on rank " in spike[0], spike
    early = results[0]["early_x1000"]["warned"]
    assert len(early) == 1 and early[0].startswith(f"step {EARLY_STEP} skipped on every rank: the loss of rank(s) "
                                                   f"[{BAD_RANK}] is more than 10x the median"), early
    assert f"on rank {BAD_RANK} against" in early[0], early
    assert results[1]["nan"]["warned"] == []  # rank 0 says it
