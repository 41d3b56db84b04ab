"""Turn a composed :class:`TrainConfig` into the Python objects it mirrors."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Optional

from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.data import StdlibCorpusDataModule, TextFilesDataModule, TokenFileDataModule
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.module import LLMModule
from lightning_mgpu.strategy import MGPUStrategy

_MODEL_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len",
                    "tie_embeddings")


def build_model_config(cfg: DictConfig) -> LlamaConfig:
    if cfg.model.init_from:  # the checkpoint's shape, whatever model.name says
        import json
        from dataclasses import replace

        from lightning_mgpu.checkpoint.hf import from_hf_config, hf_path

        hf = json.loads((hf_path(cfg.model.init_from) / "config.json").read_text())
        return replace(from_hf_config(hf), activation_checkpointing=cfg.model.activation_checkpointing)
    overrides = {k: cfg.model[k] for k in _MODEL_OVERRIDES if cfg.model[k] is not None}
    return LlamaConfig.from_name(cfg.model.name, activation_checkpointing=cfg.model.activation_checkpointing,
                                 **overrides)


def build_datamodule(cfg: DictConfig) -> TokenFileDataModule:
    d = cfg.data
    common = dict(seq_len=d.seq_len, global_batch_size=d.global_batch_size, micro_batch_size=d.micro_batch_size,
                  seed=cfg.seed, val_fraction=d.val_fraction, val_batches=d.val_batches)
    if d.source == "corpus":
        return StdlibCorpusDataModule(cache=d.cache, **common)
    if d.source == "text":
        return TextFilesDataModule(list(d.files), text_key=d.text_key, cache=d.cache, **common)
    if d.source == "tokens":
        if not d.path or not Path(d.path).exists():
            raise FileNotFoundError(f"data.path={d.path!r} does not exist; give the path of a token file")
        return TokenFileDataModule(d.path, dtype=d.dtype, **common)
    raise ValueError(f"data.source={d.source!r} is unknown; choose corpus, text or tokens")


def build_module(cfg: DictConfig, model: Optional[LlamaConfig] = None) -> LLMModule:
    o = cfg.optim
    return LLMModule(model or build_model_config(cfg), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
                     eps=o.eps, warmup_steps=o.warmup_steps, max_steps=cfg.trainer.max_steps,
                     min_lr_ratio=o.min_lr_ratio, lr_scaling=o.lr_scaling,
                     reference_batch_size=o.reference_batch_size, global_batch_size=cfg.data.global_batch_size,
                     init_seed=cfg.model.init_seed, init_from=cfg.model.init_from)


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """The selected loggers, each writing under ``run_dir`` (CSV: ``metrics.csv``; TensorBoard: ``tensorboard/``;
    W&B: ``wandb/``; MLflow: a file store in ``mlruns/`` unless ``logger.mlflow.tracking_uri`` names another)."""
    chosen, out = cfg.logger, []
    if chosen.csv is not None:
        from lightning.pytorch.loggers import CSVLogger

        flush = chosen.csv.flush_logs_every_n_steps or cfg.trainer.log_every_n_steps
        out.append(CSVLogger(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=flush))
    if chosen.tensorboard is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        tb = chosen.tensorboard
        out.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", log_graph=tb.log_graph,
                                     default_hp_metric=tb.default_hp_metric))
    if chosen.wandb is not None:
        from lightning.pytorch.loggers import WandbLogger

        wb = chosen.wandb
        out.append(WandbLogger(save_dir=str(run_dir), offline=wb.offline, project=wb.project, name=wb.name,
                               tags=list(wb.tags)))
    if chosen.mlflow is not None:
        from lightning.pytorch.loggers import MLFlowLogger

        ml = chosen.mlflow
        uri = ml.tracking_uri or (Path(run_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):  # MLflow >= 3.7 refuses its file store (now in maintenance) without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        out.append(MLFlowLogger(experiment_name=ml.experiment_name, run_name=ml.run_name, tracking_uri=uri))
    return out


def build_strategy(cfg: DictConfig) -> MGPUStrategy:
    p = OmegaConf.to_container(cfg.parallel, resolve=True)
    c = cfg.checkpoint
    timeout_s = p.pop("timeout_s")
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    return MGPUStrategy(**p, checkpoint_format=c.format, save_consolidated_weights=c.consolidated, **timeout)
