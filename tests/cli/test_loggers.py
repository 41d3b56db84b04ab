"""The ``logger`` group and Lightning's everyday Trainer keys of ``mgpu-train``.

Each logger is checked on what it wrote to disk, read back with its own format's reader: TensorBoard's event
files, the W&B offline run's record log, MLflow's file store, against the run's metrics.csv.
"""

import glob
import json
import os
import struct
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, Timer
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from forked_cli import run_cli
from cli_helpers import TINY_ARGS, composed, read_losses

from lightning_mgpu.cli.build import build_loggers
from lightning_mgpu.cli.metrics_history import ResumableCSVLogger
from lightning_mgpu.cli.train import trainer_arguments

BIN = Path(sys.executable).parent
#: csv: Lightning's CSVLogger, keeping metrics.csv across restarts
LOGGER_TYPES = {"csv": ResumableCSVLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger,
                "mlflow": MLFlowLogger}


@pytest.mark.parametrize("choice, expected", [
    ([], ["csv"]),  # the default
    (["logger=tensorboard"], ["tensorboard"]),
    (["logger=wandb", "logger.wandb.project=p"], ["wandb"]),
    (["logger=mlflow"], ["mlflow"]),
    (["logger=[csv,tensorboard,wandb,mlflow]"], ["csv", "tensorboard", "wandb", "mlflow"]),
    (["logger=[]"], []),
])
def test_every_logger_option_composes_and_builds(tmp_path, choice, expected):
    cfg = composed(*choice)
    loggers = build_loggers(cfg, tmp_path)
    assert [type(lg) for lg in loggers] == [LOGGER_TYPES[name] for name in expected]
    for lg in loggers:
        if isinstance(lg, (CSVLogger, TensorBoardLogger)):  # files under the run directory
            assert Path(lg.log_dir).resolve() in (tmp_path.resolve(), (tmp_path / "tensorboard").resolve())
        if isinstance(lg, WandbLogger):
            assert lg.save_dir == str(tmp_path) and cfg.logger.wandb.offline
        if isinstance(lg, MLFlowLogger):
            assert Path(lg.save_dir).resolve() == (tmp_path / "mlruns").resolve()  # a file store
    if not expected:
        assert trainer_arguments(cfg, tmp_path)["logger"] is False  # not Lightning's default logger either


def test_trainer_keys_compose_and_reach_the_trainer(tmp_path):
    defaults = trainer_arguments(composed("trainer.devices=1"), tmp_path)
    assert defaults["val_check_interval"] == 300 and defaults["check_val_every_n_epoch"] is None  # once, at the end
    assert defaults["limit_val_batches"] is None and defaults["num_sanity_val_steps"] == 2  # Lightning's defaults
    cfg = composed("trainer.devices=1", "logger=[]", "trainer.max_steps=40", "trainer.max_time=00:01:30:00",
                   "trainer.limit_train_batches=10", "trainer.max_epochs=3", "trainer.limit_val_batches=2",
                   "trainer.num_sanity_val_steps=0", "trainer.check_val_every_n_epoch=2",
                   "trainer.accumulate_grad_batches=4", "trainer.deterministic=true", "trainer.log_every_n_steps=5",
                   "trainer.enable_model_summary=false", "trainer.enable_progress_bar=false",
                   "trainer.gradient_clip_val=0.5")
    try:
        trainer = L.Trainer(**trainer_arguments(cfg, tmp_path))
        assert torch.are_deterministic_algorithms_enabled()
    finally:  # the Trainer set a process-wide torch flag
        torch.use_deterministic_algorithms(False)
    assert (trainer.max_steps, trainer.max_epochs) == (40, 3)
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.num_sanity_val_steps) == (10, 2, 0)
    assert (trainer.check_val_every_n_epoch, trainer.accumulate_grad_batches) == (2, 4)
    assert trainer.val_check_interval == 1.0  # at the end of each epoch (of limit_train_batches batches)
    assert (trainer.log_every_n_steps, trainer.gradient_clip_val) == (5, 0.5)
    [timer] = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert timer.time_remaining() == 90 * 60
    assert not any(isinstance(c, ModelSummary) for c in trainer.callbacks) and trainer.progress_bar_callback is None
    assert trainer.loggers == []
    fraction = trainer_arguments(composed("trainer.limit_val_batches=0.5", "trainer.accumulate_grad_batches=2"),
                                 tmp_path)
    assert fraction["limit_val_batches"] == 0.5 and fraction["val_check_interval"] == 600  # 300 steps x 2 batches


def test_one_run_writes_train_loss_to_every_logger(token_file, tmp_path):
    """One 3-step run with all four loggers: each holds the per-step train/loss of metrics.csv."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    proc = run_cli([str(BIN / "mgpu-train"), "trainer.devices=1", "data=tokens", f"data.path={token_file}",
                    "trainer.max_steps=3", *TINY_ARGS, "logger=[csv,tensorboard,wandb,mlflow]",
                    f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected = read_losses(run_dir / "metrics.csv")
    assert len(expected) == 3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(expected, rel=1e-6)  # float32 there

    [wandb_run] = glob.glob(str(run_dir / "wandb" / "offline-run-*"))  # offline: nothing was sent
    history = [row for row in wandb_history(next(Path(wandb_run).glob("run-*.wandb"))) if "train/loss" in row]
    assert [int(row["trainer/global_step"]) for row in history] == [0, 1, 2]
    assert [float(row["train/loss"]) for row in history] == expected

    [metric_file] = glob.glob(str(run_dir / "mlruns" / "*" / "*" / "metrics" / "train" / "loss"))
    rows = [line.split() for line in Path(metric_file).read_text().splitlines()]  # timestamp value step
    assert [int(step) for _, _, step in rows] == [0, 1, 2]
    assert [float(value) for _, value, _ in rows] == expected


def wandb_history(path: Path) -> list[dict]:
    """The history rows (``wandb.log`` calls) of a W&B run file, a LevelDB-style log of ``Record`` protobufs:
    a 7-byte file header, then in 32 KiB blocks, chunks with a 7-byte header (crc32, length, type: 1 whole,
    2 first, 3 middle, 4 last part of a record); a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
