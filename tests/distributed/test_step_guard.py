"""A step whose loss is NaN on one rank, a thousand times too large on one rank (from the first steps: the cross-rank
rule needs no history), or a thousand times too large on every rank at step 40 (the history rule, default settings) is
skipped on every rank: a plain LightningModule's final weights equal, bit for bit, those of a run that never saw that
batch (Adam's step count, its moments and a per-step LR schedule included), at ZeRO 0, 1 and 3; the warning names the
step, the rank and the values. The package's mixture of experts with bias balancing, under tp2, pp2 and ep2, with NaN
in one rank's loss or only in its gradients: every weight and router bias equal, bit for bit, to the run without the
batch."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from moe_helpers import TINY_MOE
from test_lightning_conformance import LogLines

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.engine.runtime import gathered
from lightning_mgpu.resilience import SpikeRule
from lightning_mgpu.testing import run_distributed

STEPS, BAD_STEP, BAD_RANK = 8, 5, 1  # step 5 counted from 0 (as metrics.csv)
EARLY_STEP = 2  # 2 steps of history, fewer than the rule's min_history (16): only the cross-rank rule can see a spike
SPIKE_STEP, LONG = 40, 42  # the whole batch x1000 at step 40 of 42: the history rule, on its default 16-step minimum


class StepBatches(Dataset):
    """Item i: this rank's batch of step i (16 points of 4 Gaussian classes), seeded by rank and step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return LONG

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
                        strategy=MGPUStrategy(zero_stage=stage, loss_spike=SpikeRule()))
    with LogLines() as log:
        trainer.fit(module)
    with gathered(list(module.parameters())):
        weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    return {"weights": weights, "skipped": [(s.step, s.ranks) for s in trainer.strategy.skipped_steps],
            "warned": [line for line in log.lines if "skipped on every rank" in line]}


def five_runs(rank: int, stage: int) -> dict:
    """The run that never sees the bad step's batch and the run where one rank's loss is NaN there; the 42-step run that
    never sees step 40's batch and the one where every rank's loss is x1000 there; the run that never sees the early
    step's batch, and the run where one rank's loss is x1000 there."""
    every, long = list(range(STEPS)), list(range(LONG))
    return {"reference": weights_after(stage, [s for s in every if s != BAD_STEP]),
            "nan": weights_after(stage, every, (BAD_STEP, BAD_RANK, "nan")),
            "long_reference": weights_after(stage, [s for s in long if s != SPIKE_STEP]),
            "x1000": weights_after(stage, long, (SPIKE_STEP, None, "x1000")),
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
        for reference in ("reference", "long_reference", "early_reference"):
            assert runs[reference]["skipped"] == [], (reference, runs[reference]["skipped"])
        for kind, reference in (("nan", "reference"), ("x1000", "long_reference"), ("early_x1000", "early_reference")):
            run = runs[kind]
            for name, expected in runs[reference]["weights"].items():
                assert torch.equal(run["weights"][name], expected), (stage, kind, rank, name)
                assert torch.isfinite(run["weights"][name]).all()
        assert runs["nan"]["skipped"] == [(BAD_STEP, (BAD_RANK,))]  # named: the rank whose loss was not finite
        assert runs["x1000"]["skipped"] == [(SPIKE_STEP, ())]  # a spike of the mean loss: no rank to blame alone
        assert runs["early_x1000"]["skipped"] == [(EARLY_STEP, (BAD_RANK,))]  # far above the other rank's loss
    warned = results[0]["nan"]["warned"]
    assert len(warned) == 1 and warned[0].startswith(f"step {BAD_STEP} skipped on every rank: the loss was not finite "
                                                     f"on rank(s) [{BAD_RANK}]"), warned
    spike = results[0]["x1000"]["warned"]
    assert len(spike) == 1 and spike[0].startswith(f"step {SPIKE_STEP} skipped on every rank: the loss ") and \
        "standard deviations above the mean" in spike[0] and "highest" in spike[0] and "on rank " in spike[0], spike
    early = results[0]["early_x1000"]["warned"]
    assert len(early) == 1 and early[0].startswith(f"step {EARLY_STEP} skipped on every rank: the loss of rank(s) "
                                                   f"[{BAD_RANK}] is more than 10x the median"), early
    assert f"on rank {BAD_RANK} against" in early[0], early
    assert results[1]["nan"]["warned"] == []  # rank 0 says it


# ------------------------------------------------------------------ the package's MoE under tp2, pp2 and ep2
#: Bias balancing on (router_bias_rate), so a skipped step's token counts, if kept, would move the next step's bias.
MOE = replace(TINY_MOE, router_bias_rate=0.01)
MOE_STEPS, MOE_BAD_STEP, SEQ = 4, 1, 16
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
           "ep2": dict(expert_parallel_size=2)}


class TokenSteps(Dataset):
    """Item i: the batch of step i of data-parallel rank ``dp`` (4 random sequences), seeded by both."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def __len__(self) -> int:
        return MOE_STEPS

    def __getitem__(self, step: int) -> torch.Tensor:
        seeded = torch.Generator().manual_seed(100 * self.dp + step)
        return torch.randint(0, MOE.vocab_size, (4, SEQ + 1), generator=seeded)


class GuardedMoE(LLMModule):
    """LLMModule on per-step batches; ``fault`` = (step, rank, "loss" | "gradients"): on that rank at that step, NaN in
    the final norm's output (the loss and every gradient) or, through a gradient hook on every parameter, NaN in the
    gradients only (the loss stays finite)."""

    def __init__(self, steps: list[int], fault: Optional[tuple[int, int, str]] = None) -> None:
        super().__init__(MOE, lr=3e-3, warmup_steps=1, max_steps=10, global_batch_size=None)
        self.steps, self.fault, self.hooks = steps, fault, []

    def train_dataloader(self) -> DataLoader:
        dp = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        return DataLoader(TokenSteps(dp), batch_size=None, sampler=self.steps)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        step, rank, kind = self.fault or (None, None, None)
        if self.trainer.global_step != step or self.global_rank != rank:
            return
        model = self.trainer.strategy.model.module
        if kind == "loss":
            norm = [m for name, m in model.named_modules() if name.split(".")[-1] == "norm" and "layers" not in name]
            self.hooks.append(norm[-1].register_forward_hook(lambda m, a, out: out * math.nan))
        else:
            self.hooks += [p.register_hook(lambda g: g * math.nan) for p in model.parameters() if p.requires_grad]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def moe_state_after(layout: dict, steps: list[int], fault: Optional[tuple[int, int, str]] = None) -> dict:
    module = GuardedMoE(steps, fault)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=len(steps), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        strategy=MGPUStrategy(**layout))
    trainer.fit(module)
    model = trainer.strategy.model.module
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state.update({name: b.clone() for name, b in model.named_buffers() if "expert_bias" in name})
    return {"state": state, "skipped": [(s.step, s.ranks, s.reason) for s in trainer.strategy.skipped_steps],
            "biases_moved": any(b.abs().sum() > 0 for n, b in model.named_buffers() if "expert_bias" in n)}


@pytest.fixture(scope="module")
def moe_layouts():
    """Per layout: the run without step 1's batch, and the runs where rank 1's loss, or only its gradients, are NaN
    at step 1; all in one launch of 2 ranks."""
    every = list(range(MOE_STEPS))
    runs = lambda rank: {name: {"reference": moe_state_after(kw, [s for s in every if s != MOE_BAD_STEP]),
                                **{kind: moe_state_after(kw, every, (MOE_BAD_STEP, BAD_RANK, kind))
                                   for kind in ("loss", "gradients")}}
                         for name, kw in LAYOUTS.items()}
    results = run_distributed(runs, 2)
    return {name: [r[name] for r in results] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_skipped_step_moves_no_weight_and_no_router_bias_under_tp_pp_and_ep(moe_layouts, layout):
    """NaN in rank 1's loss, or in its gradients only, at step 1: skipped on every rank, and every weight and every
    router's balancing bias ends bit for bit where the run that never drew the batch ends (the skipped batch's token
    counts are not carried into the next bias update)."""
    for rank, runs in enumerate(moe_layouts[layout]):
        assert runs["reference"]["skipped"] == [] and runs["reference"]["biases_moved"], (layout, rank)
        for kind in ("loss", "gradients"):
            (step, ranks, reason), = runs[kind]["skipped"]
            assert step == MOE_BAD_STEP and BAD_RANK in ranks, (layout, kind, rank, ranks)
            assert ("loss was not finite" in reason) == (kind == "loss"), reason  # a gradient-only NaN: finite loss
            assert "gradients were not finite" in reason or kind == "loss", reason
            for name, expected in runs["reference"]["state"].items():
                got = runs[kind]["state"][name]
                assert torch.equal(got, expected), (layout, kind, rank, name, (got - expected).abs().max())
