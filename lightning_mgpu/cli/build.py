"""Turn a composed :class:`TrainConfig` into the Python objects it mirrors."""

from __future__ import annotations

import os
from dataclasses import replace
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
    """The model of ``cfg``; with ``data.document_mask`` it carries the data's end-of-document id
    (``LlamaConfig.eod_token_id``), which is what turns the document mask on in the model, the loss and the planner.
    Left without one where the data has none, or an id the vocabulary lacks: validation refuses such a run before it
    starts (``document_mask_problems``, ``vocabulary_problems``), naming the data rather than this field."""
    if cfg.model.init_from:  # the checkpoint's shape, whatever model.name says
        import json

        from lightning_mgpu.checkpoint.hf import from_hf_config, hf_path

        hf = json.loads((hf_path(cfg.model.init_from) / "config.json").read_text())
        model = replace(from_hf_config(hf), activation_checkpointing=cfg.model.activation_checkpointing,
                        compile=cfg.model.compile, compile_backend=cfg.model.compile_backend)
    else:
        overrides = {k: cfg.model[k] for k in _MODEL_OVERRIDES if cfg.model[k] is not None}
        model = LlamaConfig.from_name(cfg.model.name, activation_checkpointing=cfg.model.activation_checkpointing,
                                      compile=cfg.model.compile, compile_backend=cfg.model.compile_backend,
                                      **overrides)
    if cfg.data.get("document_mask"):  # .get: a schema without the key reads as false
        eod = run_eod_token_id(cfg)[0]
        if eod is not None and eod < model.vocab_size:
            model = replace(model, eod_token_id=eod)
    return model


def data_sources(cfg: DictConfig) -> list[tuple[str, float]]:
    """``data.sources`` as (path, weight) pairs (a source without a weight weighs 1); empty when there are none."""
    sources = cfg.data.get("sources")  # .get: a schema without the key reads as none
    if not sources:
        return []
    items = OmegaConf.to_container(sources, resolve=True)
    return [(s.get("path"), s.get("weight", 1.0)) if isinstance(s, dict) else (s, 1.0) for s in items]


def token_paths(cfg: DictConfig) -> list[str]:
    """The token sources of ``data=tokens``: each of ``data.sources``, or ``data.path``."""
    if cfg.data.source != "tokens":
        return []
    sources = data_sources(cfg)
    if sources:
        return [str(p) for p, _ in sources]
    return [str(cfg.data.path)] if cfg.data.path else []


def run_tokenizer(cfg: DictConfig) -> Optional[tuple[Path, str]]:
    """(tokenizer path, how to name it in messages) of a run, or None for byte tokens: ``data.tokenizer``; else the
    ``tokenizer.json`` beside ``model.init_from``'s weights; else the tokenizer the prepared tokens were made with,
    where that file is still there unchanged."""
    explicit = cfg.data.get("tokenizer")
    if explicit:
        return Path(explicit), f"data.tokenizer={explicit!r}"
    if cfg.model.init_from:
        from lightning_mgpu.checkpoint.hf import hf_path
        from lightning_mgpu.data.tokenizer import TOKENIZER_FILE

        beside = hf_path(cfg.model.init_from) / TOKENIZER_FILE
        if beside.is_file():
            return beside, f"the tokenizer of model.init_from={cfg.model.init_from!r} ({beside})"
    from lightning_mgpu.data.manifest import PreparedDataError, is_prepared, read_manifest
    from lightning_mgpu.data.tokenizer import file_sha256

    for path in token_paths(cfg):
        if not is_prepared(path):
            continue
        try:
            manifest = read_manifest(path)
        except PreparedDataError:
            return None  # validation names what is wrong with it
        recorded = Path(manifest.tokenizer_path)
        if recorded.is_file() and file_sha256(recorded) == manifest.tokenizer_sha256:
            return recorded, f"the tokenizer {path} was prepared with ({recorded})"
        return None
    return None


def lost_tokenizer(cfg: DictConfig) -> Optional[str]:
    """The tokenizer the run's prepared tokens were made with, when the run has no tokenizer because that file moved
    or changed (its ids are then not bytes, and decoding them as bytes would print noise); else None."""
    if run_tokenizer(cfg) is not None:
        return None
    from lightning_mgpu.data.manifest import PreparedDataError, is_prepared, read_manifest

    for path in token_paths(cfg):
        if is_prepared(path):
            try:
                return read_manifest(path).tokenizer_path
            except PreparedDataError:
                return None
    return None


def run_eod_token_id(cfg: DictConfig) -> tuple[Optional[int], str]:
    """(the id that ends every document in the run's tokens, where it comes from), or (None, why the data has none).

    A prepared directory's manifest records the id mgpu-prepare appended (every prepared source of a run must have
    the same one); otherwise the run's tokenizer's end-of-document token, which the data modules' own preparation of
    ``data=corpus``/``data=text`` appends (for a flat token file it is taken on trust). Byte tokens mark no document
    ends."""
    from lightning_mgpu.data.manifest import PreparedDataError, is_prepared, read_manifest
    from lightning_mgpu.data.tokenizer import Tokenizer, TokenizerError

    for path in token_paths(cfg):
        if is_prepared(path):
            try:
                manifest = read_manifest(path)
            except PreparedDataError as err:
                return None, str(err)
            return manifest.eod_id, f"the manifest of {path} ({manifest.eod_token!r})"
    found = run_tokenizer(cfg)
    if found is None:
        if cfg.data.source == "tokens":
            return None, "a flat token file records no end-of-document id and no tokenizer is given"
        return None, f"data.source={cfg.data.source} without a tokenizer gives byte tokens, which mark no document ends"
    try:
        token, eod = Tokenizer(found[0]).eod_token()
    except TokenizerError as err:
        return None, f"{found[1]}: {err}"
    return eod, f"{found[1]} ({token!r})"


def build_tokenizer(cfg: DictConfig):
    """The run's :class:`~lightning_mgpu.data.tokenizer.Tokenizer`, or None for byte tokens."""
    found = run_tokenizer(cfg)
    if found is None:
        return None
    from lightning_mgpu.data.tokenizer import Tokenizer

    return Tokenizer(found[0])


def build_datamodule(cfg: DictConfig) -> TokenFileDataModule:
    d = cfg.data
    common = dict(seq_len=d.seq_len, global_batch_size=d.global_batch_size, micro_batch_size=d.micro_batch_size,
                  seed=cfg.seed, val_fraction=d.val_fraction, val_batches=d.val_batches)
    found = run_tokenizer(cfg)
    tokenizer = None if found is None else found[0]
    if d.source == "corpus":
        return StdlibCorpusDataModule(cache=d.cache, tokenizer=tokenizer, **common)
    if d.source == "text":
        return TextFilesDataModule(list(d.files), text_key=d.text_key, cache=d.cache, tokenizer=tokenizer, **common)
    if d.source == "tokens":
        sources = data_sources(cfg)
        if sources:
            return TokenFileDataModule(sources=sources, dtype=d.dtype, tokenizer=tokenizer, **common)
        if not d.path or not Path(d.path).exists():
            raise FileNotFoundError(f"data.path={d.path!r} does not exist; give a directory written by mgpu-prepare "
                                    "or a token file")
        return TokenFileDataModule(d.path, dtype=d.dtype, tokenizer=tokenizer, **common)
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
    if p["timeout"] is None:
        del p["timeout"]  # torch's default
    # checkpoint.<key> is MGPUStrategy's checkpoint_<key> where the argument needs the prefix to be clear
    return MGPUStrategy(**p, checkpoint_format=c.format, save_consolidated_weights=c.save_consolidated_weights,
                        trust_deepspeed_checkpoints=c.trust_deepspeed_checkpoints)
