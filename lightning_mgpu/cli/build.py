"""Turn a resolved run (:class:`~lightning_mgpu.cli.spec.RunSpec`) into the Python objects it mirrors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.metrics_history import ResumableCSVLogger
from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.cli.spec import RunSpec
from lightning_mgpu.data import StdlibCorpusDataModule, TextFilesDataModule, TokenFileDataModule
from lightning_mgpu.layout import LayoutRequest
from lightning_mgpu.precision import MGPUPrecision
from lightning_mgpu.strategy import MGPUStrategy


def build_tokenizer(spec: RunSpec):
    """The run's :class:`~lightning_mgpu.data.tokenizer.Tokenizer`, or None for byte tokens."""
    if spec.data.tokenizer is None:
        return None
    from lightning_mgpu.data.tokenizer import Tokenizer

    return Tokenizer(spec.data.tokenizer.path)


def build_datamodule(spec: RunSpec) -> TokenFileDataModule:
    """The data module of ``data.source`` (the data rules accept only corpus, text, tokens and sft)."""
    cfg = spec.config
    d = cfg.data
    common = dict(seq_len=d.seq_len, global_batch_size=d.global_batch_size, micro_batch_size=d.micro_batch_size,
                  seed=cfg.seed, val_fraction=d.val_fraction, val_batches=d.val_batches,
                  tokenizer=spec.data.tokenizer_path, skip_batches=list(d.skip_batches))
    if d.source == "corpus":
        return StdlibCorpusDataModule(cache=d.cache, **common)
    if d.source == "text":
        return TextFilesDataModule(list(d.files), text_key=d.text_key, cache=d.cache, **common)
    if d.source == "sft":
        from lightning_mgpu.data.sft import SFTDataModule

        return SFTDataModule(d.path, **common)
    if spec.data.sources:
        return TokenFileDataModule(sources=list(spec.data.sources), dtype=d.dtype, **common)
    return TokenFileDataModule(d.path, dtype=d.dtype, **common)


def build_module(spec: RunSpec) -> L.LightningModule:
    """The module of the run's model source (:mod:`lightning_mgpu.cli.model_source`): ``LLMModule``, or with
    ``model=hf`` the ``transformers`` model of ``model.path`` as it is (``HFCausalLM``)."""
    cfg = spec.config
    o = cfg.optim
    common = dict(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps, warmup_steps=o.warmup_steps,
                  max_steps=cfg.trainer.max_steps, min_lr_ratio=o.min_lr_ratio, optimizer=o.name,
                  muon_momentum=o.muon_momentum, muon_ns_dtype=o.muon_ns_dtype,
                  adapters=OmegaConf.to_container(cfg.adapters, resolve=True))
    return model_source(cfg).build_module(spec, common)


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """The selected loggers, each writing under ``run_dir`` (CSV: ``metrics.csv``; TensorBoard: ``tensorboard/``;
    W&B: ``wandb/``; MLflow: a file store in ``mlruns/`` unless ``logger.mlflow.tracking_uri`` names another)."""
    chosen, out = cfg.logger, []
    if chosen.csv is not None:
        flush = chosen.csv.flush_logs_every_n_steps or cfg.trainer.log_every_n_steps
        out.append(ResumableCSVLogger(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=flush))
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


def build_strategy(spec: RunSpec) -> MGPUStrategy:
    """``MGPUStrategy`` of the run: its layout request, the other ``parallel.*`` keys (each named as its argument), the
    checkpoint settings and ``bad_steps.*``."""
    layout = {name: getattr(spec.layout, name) for name in LayoutRequest.__dataclass_fields__}
    rest = {k: v for k, v in OmegaConf.to_container(spec.config.parallel, resolve=True).items() if k not in layout}
    if rest["timeout"] is None:
        del rest["timeout"]  # torch's default
    c, bad = spec.config.checkpoint, spec.config.bad_steps
    spike = OmegaConf.to_container(bad.loss_spike) if bad.loss_spike is not None else None
    # checkpoint.<key> is MGPUStrategy's checkpoint_<key> where the argument needs the prefix to be clear
    return MGPUStrategy(**layout, **rest, checkpoint_format=spec.checkpoint.format,
                        save_consolidated_weights=c.save_consolidated_weights,
                        trust_deepspeed_checkpoints=spec.checkpoint.trust_deepspeed_checkpoints,
                        skip_bad_steps=bad.skip, loss_spike=spike, precision_plugin=precision_plugin(spec.config.trainer))


def precision_plugin(t: DictConfig) -> Optional[MGPUPrecision]:
    """``trainer.fp8`` set: the precision plugin of ``trainer.precision`` with fp8 (Lightning's own otherwise)."""
    return None if t.fp8 is None else MGPUPrecision(str(t.precision), fp8=t.fp8)
