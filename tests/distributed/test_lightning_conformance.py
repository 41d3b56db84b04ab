"""A plain LightningModule (not LLMModule) with its own DataLoaders and callbacks trains under MGPUStrategy as it does
under DDPStrategy, on the same data: per-step losses, samples seen, optimizer steps and LRs; what cannot work is refused
at setup by name. Run as a script, it prints the conformance table (feature x ZeRO stage) that
docs/how-to/own-model.md quotes."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset

from helpers import assert_layout_applied

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.testing import run_distributed

N_SAMPLES, BATCH = 128, 8  # 2 ranks: 8 batches per rank per epoch
ZERO = {"zero0": dict(zero_stage=0), "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2),
        "zero3": dict(zero_stage=3), "zero3_offload": dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")}


class Samples(Dataset):
    """Seeded points of four Gaussian classes; each item carries its index, so a test can see who got what."""

    def __init__(self, n: int = N_SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + F.one_hot(self.y, 16).float() * 2.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Classifier(L.LightningModule):
    """Two linear layers, AdamW and an LR schedule: what a Lightning user writes, nothing MGPUStrategy-specific."""

    def __init__(self, manual: bool = False, interval: str = "step", optimizers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.automatic_optimization = not manual
        self.interval, self.n_optimizers = interval, optimizers
        self.losses: list[float] = []
        self.seen: list[int] = []
        self.gathered: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        self.seen += idx.tolist()
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return None

    def on_train_epoch_end(self) -> None:
        if not self.losses:  # resumed from a checkpoint written after the epoch's last batch
            return
        mean = torch.tensor(self.losses[-1])
        self.gathered.append(self.all_gather(mean).flatten().tolist())

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("test_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _, idx = batch
        return idx, self.net(x).argmax(-1)

    def configure_optimizers(self):
        opts = [torch.optim.AdamW(self.net.parameters(), lr=1e-2) for _ in range(self.n_optimizers)]
        scheduler = torch.optim.lr_scheduler.StepLR(opts[0], step_size=3 if self.interval == "step" else 1, gamma=0.5)
        if self.n_optimizers > 1:
            return opts
        return {"optimizer": opts[0], "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


def loader(shuffle: bool = True, n: int = N_SAMPLES) -> DataLoader:
    return DataLoader(Samples(n), batch_size=BATCH, shuffle=shuffle)


class Steps(L.Callback):
    """The optimizer step and learning rate after each training batch."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.steps.append(trainer.global_step)
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


class TensorParallelClassifier(Classifier):
    """The same classifier with a tensor-parallel plan: its first layer split by output features, its second by input
    features (what a user adds to run it at ``tensor_parallel_size=2``)."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"net.0": "colwise_enter", "net.2": "rowwise"}


def train(rank: int, strategy: Any, max_epochs: int = 2, max_steps: int = -1, callbacks: Optional[list] = None,
          module_kw: Optional[dict] = None, trainer_kw: Optional[dict] = None, fit_kw: Optional[dict] = None,
          after: Optional[str] = None, root: Optional[str] = None, devices: int = 2,
          module_cls: type = Classifier, n_samples: int = N_SAMPLES) -> dict:
    """One fit of the Classifier on CPU processes; ``after`` runs ``test``/``validate``/``predict`` afterwards (from
    ``ckpt_path="best"`` when a ModelCheckpoint is configured)."""
    asked = strategy if isinstance(strategy, dict) else None
    strategy = MGPUStrategy(**strategy) if isinstance(strategy, dict) else strategy
    steps = Steps()
    module = module_cls(**(module_kw or {}))
    kw = dict(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs, max_steps=max_steps,
              logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              enable_checkpointing=False, callbacks=[steps, *(callbacks or [])], default_root_dir=root)
    kw.update(trainer_kw or {})
    trainer = L.Trainer(**kw)
    trainer.fit(module, train_dataloaders=loader(n=n_samples), val_dataloaders=loader(shuffle=False),
                **(fit_kw or {}))
    if asked is not None:
        assert_layout_applied(trainer, devices, asked)
    out = {"losses": module.losses, "seen": module.seen, "steps": steps.steps, "lrs": steps.lrs,
           "gathered": module.gathered, "global_step": trainer.global_step,
           "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
           "shapes": {n: tuple(p.shape) for n, p in module.named_parameters()}}
    best = "best" if any(isinstance(cb, ModelCheckpoint) for cb in trainer.callbacks) else None
    if after == "test":
        out["after"] = float(trainer.test(module, loader(shuffle=False), ckpt_path=best)[0]["test_loss"])
    elif after == "validate":
        out["after"] = float(trainer.validate(module, loader(shuffle=False), ckpt_path=best)[0]["val_loss"])
    elif after == "predict":
        out["after"] = [(i.tolist(), p.tolist()) for i, p in trainer.predict(module, loader(shuffle=False),
                                                                             ckpt_path=best)]
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            out["best"], out["last"] = cb.best_model_path, cb.last_model_path
    return out


def assert_same_training(got: list[dict], ddp: list[dict], tol: float = 1e-5) -> None:
    """Per rank: the same samples in the same order, the same per-batch losses, steps and LRs as under DDP."""
    for g, d in zip(got, ddp):
        assert g["seen"] == d["seen"]
        assert len(g["losses"]) == len(d["losses"]) and max(abs(a - b) for a, b in zip(g["losses"], d["losses"])) < tol
        assert g["steps"] == d["steps"] and g["global_step"] == d["global_step"]
        assert g["lrs"] == pytest.approx(d["lrs"], rel=1e-12)


@pytest.fixture(scope="module")
def ddp():
    return run_distributed(train, 2, "ddp", max_steps=10)


#: Epochs of 7 batches per rank with accumulate_grad_batches=2: the last batch of each epoch steps alone, as Lightning
#: does under DDP (it never carries gradients into the next epoch).
ACCUMULATE = dict(trainer_kw=dict(accumulate_grad_batches=2), n_samples=112)


@pytest.fixture(scope="module")
def ddp_accumulate():
    return run_distributed(train, 2, "ddp", **ACCUMULATE)


# ZeRO-1 and plain ZeRO-3 rows of the table in docs/how-to/own-model.md come from the script run (see
# conformance_table); the tests run
# the stages that differ most in how gradients and parameters are held.
@pytest.mark.parametrize("stage", ["zero0", "zero2", "zero3_offload"])
def test_plain_module_trains_as_under_ddp(ddp, stage):
    got = run_distributed(train, 2, ZERO[stage], max_steps=10)
    assert_same_training(got, ddp)
    # The DistributedSampler shards over the data-parallel group: the ranks see disjoint samples, 8 batches each.
    first_epoch = [set(r["seen"][:8 * BATCH]) for r in got]
    assert not first_epoch[0] & first_epoch[1] and len(first_epoch[0] | first_epoch[1]) == N_SAMPLES
    assert got[0]["gathered"] == ddp[0]["gathered"]  # self.all_gather
    assert got[0]["metrics"]["train_loss"] == pytest.approx(ddp[0]["metrics"]["train_loss"], abs=1e-5)  # sync_dist


def test_tensor_parallel_ranks_share_their_replicas_samples(ddp):
    """tp2 x dp2 on 4 processes against DDP on 2: both ranks of a tensor-parallel pair see DDP rank d's samples and
    losses; predict shards over the data-parallel group too."""
    got = run_distributed(train, 4, dict(tensor_parallel_size=2, zero_stage=1), max_steps=10, devices=4,
                          module_cls=TensorParallelClassifier, after="predict")
    assert_same_training(got, [ddp[0], ddp[0], ddp[1], ddp[1]])
    assert all(r["shapes"] == {"net.0.weight": (16, 16), "net.0.bias": (16,), "net.2.weight": (4, 16),
                               "net.2.bias": (4,)} for r in got)  # each rank holds half of each split layer
    predicted = [sorted(i for ids, _ in r["after"] for i in ids) for r in got]
    assert predicted[0] == predicted[1] and predicted[2] == predicted[3]
    assert not set(predicted[0]) & set(predicted[2]) and len(predicted[0]) + len(predicted[2]) == N_SAMPLES


@pytest.mark.parametrize("stage", ["zero0", "zero2", "zero3"])
def test_accumulate_grad_batches_steps_once_per_n_batches_as_under_ddp(ddp_accumulate, stage):
    got = run_distributed(train, 2, ZERO[stage], **ACCUMULATE)
    assert_same_training(got, ddp_accumulate)
    assert got[0]["global_step"] == 8  # 2 epochs x (3 pairs + the odd last batch)


@pytest.fixture(scope="module")
def ddp_manual():
    return run_distributed(train, 2, "ddp", max_steps=6, module_kw=dict(manual=True))


@pytest.mark.parametrize("stage", ["zero0", "zero3"])
def test_manual_optimization_as_under_ddp(ddp_manual, stage):
    ddp = ddp_manual
    got = run_distributed(train, 2, ZERO[stage], max_steps=6, module_kw=dict(manual=True))
    assert_same_training(got, ddp)


def test_epoch_scheduler_lr_monitor_early_stopping_and_own_sampler(tmp_path):
    def run(rank, strategy, log_dir):
        lr_monitor = LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True)
        stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # stops after the second validation
        out = train(rank, strategy, max_epochs=5, callbacks=[lr_monitor, stop], module_kw=dict(interval="epoch"),
                    trainer_kw=dict(use_distributed_sampler=False, log_every_n_steps=1,
                                    logger=L.pytorch.loggers.CSVLogger(log_dir)))
        rows = list(csv.DictReader(next(Path(log_dir).rglob("metrics.csv")).open())) if rank == 0 else []
        out["lr-logged"] = [[r[k] for k in ("lr-AdamW", "lr-AdamW-momentum", "lr-AdamW-weight_decay")]
                            for r in rows if r.get("lr-AdamW")]
        return out

    # use_distributed_sampler=False: every rank iterates the whole dataset with the user's own (random) sampler
    ddp = run_distributed(run, 2, "ddp", str(tmp_path / "ddp"))
    got = run_distributed(run, 2, dict(zero_stage=2), str(tmp_path / "mgpu"))
    assert_same_training(got, ddp)
    assert len(got[0]["seen"]) == 2 * N_SAMPLES  # two epochs, all samples each: early stopping ended the fit
    assert got[0]["lrs"][0] == 1e-2 and got[0]["lrs"][-1] < 1e-2  # interval="epoch": the LR fell at an epoch end
    assert len(got[0]["lr-logged"]) == len(got[0]["steps"]) and got[0]["lr-logged"] == ddp[0]["lr-logged"]


class LogLines(logging.Handler):
    """The messages Lightning's loggers (``rank_zero_info`` among them) emit while it is attached."""

    NAMES = ("lightning.pytorch", "lightning.fabric")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "LogLines":
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


def test_model_checkpoint_top_k_last_and_resume(tmp_path):
    def run(rank, name, max_epochs, resume=None, after=None):
        # mode="max": the best checkpoint is the earliest (highest loss), never the weights fit ends with
        ckpt = ModelCheckpoint(dirpath=str(tmp_path / name), monitor="val_loss", mode="max", save_top_k=1,
                               save_last=True, every_n_train_steps=4)
        with LogLines() as log:
            out = train(rank, dict(zero_stage=3), max_epochs=max_epochs, callbacks=[ckpt], root=str(tmp_path),
                        after=after, fit_kw=dict(ckpt_path=resume) if resume else None,
                        trainer_kw=dict(enable_checkpointing=True, val_check_interval=4))
        out["best_score"] = float(ckpt.best_model_score)
        out["resumed_lines"] = [line for line in log.lines if line.startswith("Resumed at step")]
        return out

    whole = run_distributed(run, 2, "whole", 3)
    first = run_distributed(run, 2, "first", 1, after="validate")
    files = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert len(files) == 2 and "last.ckpt" in files, files  # top-1 by val_loss, plus last
    assert (tmp_path / "first" / "last.ckpt" / "trainer_state.pt").is_file()  # this project's (universal) format
    # validate(ckpt_path="best") loaded the best (step-4) weights, not the ones fit ended with
    assert first[0]["after"] == pytest.approx(first[0]["best_score"], abs=1e-6)
    assert abs(first[0]["after"] - first[0]["metrics"]["val_loss"]) > 1e-3
    resumed = run_distributed(run, 2, "first", 3, resume="last", after="test")
    # one line on rank 0 (none elsewhere) names the step and the file, without a PeriodicCheckpoint in the run
    assert resumed[0]["resumed_lines"] == [f"Resumed at step 8 from {tmp_path / 'first' / 'last.ckpt'}"]
    assert resumed[1]["resumed_lines"] == [] and whole[0]["resumed_lines"] == []
    for r, w in zip(resumed, whole):  # epochs 2 and 3 continue exactly as the uninterrupted run
        assert r["losses"] == pytest.approx(w["losses"][8:], abs=1e-6)
        assert r["steps"] == w["steps"][8:]
    assert math.isfinite(resumed[0]["after"])  # test(ckpt_path="best")


def test_refused_at_setup_with_what_to_do_instead():
    def refused(rank, **kw):
        try:
            train(rank, **kw)
        except (ValueError, NotImplementedError) as err:
            return str(err)
        return "trained"

    # (with automatic optimization Lightning itself refuses a second optimizer)
    two = run_distributed(refused, 2, strategy=dict(zero_stage=2), module_kw=dict(optimizers=2, manual=True))[0]
    assert "configure_optimizers returned 2 optimizers" in two
    swa = run_distributed(refused, 2, strategy=dict(zero_stage=1),
                          callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])[0]
    assert "StochasticWeightAveraging" in swa and "not supported" in swa


@pytest.mark.parametrize("update", ["local", "async"])
def test_plain_module_trains_with_replicas_stepping_apart(update):
    """The Classifier with its own DataLoaders, 2 epochs with validation after each, as 2 replicas of one rank that
    step apart (H=2): each epoch the replicas read disjoint halves of the data, the loss falls, and the validation
    loss after the last (outer) step is logged."""
    results = run_distributed(train, 2, dict(zero_stage=1, replicas=2, replica_update=update, sync_every=2),
                              trainer_kw=dict(limit_val_batches=2))
    half = N_SAMPLES // 2
    for epoch in range(2):
        shards = [set(r["seen"][epoch * half:(epoch + 1) * half]) for r in results]
        assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == N_SAMPLES
    for r in results:
        assert r["global_step"] == 16 and r["losses"][-1] < r["losses"][0] - 0.3 and "val_loss" in r["metrics"]


def _compare(ddp: list[dict], stage: str, **kw: Any) -> str:
    try:
        assert_same_training(run_distributed(train, 2, ZERO[stage], **kw), ddp)
        return "works"
    except AssertionError:
        return "DIFFERS"
    except Exception as err:  # a refusal: its first line
        return "refused: " + str(err).splitlines()[-1].strip(" -")[:60]


def conformance_table() -> str:
    """Feature x ZeRO stage against DDPStrategy on 2 CPU processes: 'works' (same samples, losses, steps and LRs as
    DDP) or the refusal. Run this file as a script to print it (about two minutes on 2 cores)."""
    rows = {
        "plain module, own DataLoader (sharded)": (dict(max_steps=10), {}),
        "accumulate_grad_batches=2": (ACCUMULATE, {}),
        "manual optimization": (dict(max_steps=6, module_kw=dict(manual=True)), {}),
    }
    lines = ["| feature | " + " | ".join(ZERO) + " |", "|---" * (len(ZERO) + 1) + "|"]
    for feature, (kw, _) in rows.items():
        ddp = run_distributed(train, 2, "ddp", **kw)
        lines.append(f"| {feature} | " + " | ".join(_compare(ddp, stage, **kw) for stage in ZERO) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)  # forked children deadlock in their first matmul after the parent starts OpenMP
    print(conformance_table())
