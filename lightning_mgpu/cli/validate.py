"""Everything wrong with a composed config, found before any process or process group exists.

``config_problems`` returns one line per problem, each naming the key, its value, the rule and a fix, so
``mgpu-train`` can refuse a bad run in one message instead of failing minutes later inside DeepSpeed or
torch. It only reads the config (and the file system for data paths); it builds no model.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from lightning_mgpu.data import BYTE_VOCAB_SIZE
from lightning_mgpu.data.batching import batch_problems
from lightning_mgpu.layout import V_SCHEDULES, ModelShape, layout_problems
from lightning_mgpu.models import LLAMA_SHAPES, LlamaConfig
from lightning_mgpu.models.llama_plan import boundary_problems
from lightning_mgpu.precision import SUPPORTED_PRECISIONS

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCHERS = ("local", "torchrun", "slurm")
DATA_SOURCES = ("corpus", "text", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
_PARALLEL_KEYS = ("world_size", "tensor_parallel_size", "pipeline_parallel_size", "zero_stage", "pipeline_schedule",
                  "virtual_pipeline_size", "num_microbatches", "sequence_parallel", "offload_optimizer",
                  "offload_params", "pipeline_parallel_size*virtual_pipeline_size")


def _positive(key: str, value, allow_zero: bool = False) -> list[str]:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [f"{key}={value!r} must be an integer >= {low}"]
    return []


def model_problems(cfg: DictConfig) -> tuple[Optional[LlamaConfig], list[str]]:
    """(the model config when it can be built, its problems)."""
    m = cfg.model
    if m.init_from:
        from lightning_mgpu.checkpoint.hf import hf_path

        if not (hf_path(m.init_from) / "config.json").is_file():
            return None, [f"model.init_from={m.init_from!r} is not a Hugging Face Llama directory (no config.json); "
                          "give hf:PATH of a directory with config.json and *.safetensors"]
    if m.name not in LLAMA_SHAPES:
        return None, [f"model.name={m.name!r} is unknown; choose one of {', '.join(LLAMA_SHAPES)} (or model=NAME)"]
    out: list[str] = []
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
        if m[key] is not None:
            out += _positive(f"model.{key}", m[key])
    if m.activation_checkpointing not in ("none", "full"):
        out.append(f"model.activation_checkpointing={m.activation_checkpointing!r}; choose none or full")
    if out:
        return None, out
    from lightning_mgpu.cli.build import build_model_config

    try:
        return build_model_config(cfg), []
    except ValueError as err:  # LlamaConfig lists its own rules (head_dim, heads vs kv heads, ...)
        return None, [f"model: {line.strip(' -')}" for line in str(err).splitlines()[1:]]


def data_problems(cfg: DictConfig, model: Optional[LlamaConfig]) -> list[str]:
    d = cfg.data
    out = _positive("data.seq_len", d.seq_len) + _positive("data.val_batches", d.val_batches)
    if d.source not in DATA_SOURCES:
        out.append(f"data.source={d.source!r} is unknown; choose one of {', '.join(DATA_SOURCES)} (or data=NAME)")
    elif d.source == "tokens":
        if not d.path or not Path(d.path).is_file():
            out.append(f"data.path={d.path!r} does not exist; give the path of a token file (data=tokens)")
        if d.dtype not in TOKEN_DTYPES:
            out.append(f"data.dtype={d.dtype!r} is not a token dtype; choose {' or '.join(TOKEN_DTYPES)}")
    elif d.source == "text":
        if not d.files:
            out.append("data.files is empty; give glob patterns of .txt/.jsonl files, e.g. 'data.files=[books/*.txt]'")
        for pattern in d.files:
            if not glob.glob(pattern, recursive=True):
                out.append(f"data.files pattern {pattern!r} matches no file")
    if not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.01")
    if model is not None:
        if d.source in ("corpus", "text") and model.vocab_size < BYTE_VOCAB_SIZE:
            out.append(f"model.vocab_size={model.vocab_size} is smaller than the {BYTE_VOCAB_SIZE} byte tokens of "
                       f"data.source={d.source}; set model.vocab_size>={BYTE_VOCAB_SIZE}")
        if isinstance(d.seq_len, int) and d.seq_len > model.max_seq_len:
            out.append(f"data.seq_len={d.seq_len} exceeds the model's max_seq_len={model.max_seq_len}; lower "
                       f"data.seq_len or set model.max_seq_len>={d.seq_len}")
    return out


def trainer_problems(cfg: DictConfig) -> list[str]:
    t = cfg.trainer
    out = _positive("trainer.devices", t.devices) + _positive("trainer.num_nodes", t.num_nodes)
    out += _positive("trainer.max_steps", t.max_steps) + _positive("trainer.log_every_n_steps", t.log_every_n_steps)
    if t.val_check_interval is not None:
        out += _positive("trainer.val_check_interval", t.val_check_interval)
    if t.accelerator not in ACCELERATORS:
        out.append(f"trainer.accelerator={t.accelerator!r} is unknown; choose one of {', '.join(ACCELERATORS)}")
    if str(t.precision) not in SUPPORTED_PRECISIONS:
        out.append(f"trainer.precision={t.precision!r} is not supported; choose one of {', '.join(SUPPORTED_PRECISIONS)}")
    if t.gradient_clip_val is not None and t.gradient_clip_val < 0:
        out.append(f"trainer.gradient_clip_val={t.gradient_clip_val} must be >= 0 (or null for no clipping)")
    if cfg.cluster.launcher not in LAUNCHERS:
        out.append(f"cluster.launcher={cfg.cluster.launcher!r} is unknown; choose cluster=local, torchrun or slurm")
    return out


def optim_problems(cfg: DictConfig) -> list[str]:
    o = cfg.optim
    out = _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if not o.lr > 0:
        out.append(f"optim.lr={o.lr} must be > 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        out.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be between 0 and 1 (the final LR as a fraction of the peak)")
    if o.weight_decay < 0:
        out.append(f"optim.weight_decay={o.weight_decay} must be >= 0")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(f"optim.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if o.lr_scaling not in (None, "linear", "sqrt"):
        out.append(f"optim.lr_scaling={o.lr_scaling!r} is unknown; choose null, linear or sqrt")
    elif o.lr_scaling and not o.reference_batch_size:
        out.append(f"optim.lr_scaling={o.lr_scaling!r} needs optim.reference_batch_size (the batch the LR was tuned "
                   "for)")
    return out


def parallel_problems(cfg: DictConfig, model: Optional[LlamaConfig]) -> list[str]:
    """The layout against the devices, the model and the batch, as ``parallel.*`` keys."""
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    sizes_ok = not (_positive("trainer.devices", t.devices) or _positive("trainer.num_nodes", t.num_nodes))
    world = t.devices * t.num_nodes if sizes_ok else 1
    shape = None if model is None else ModelShape.of(model)
    T, P = p.tensor_parallel_size, p.pipeline_parallel_size
    dp = world // (T * P) if isinstance(T, int) and isinstance(P, int) and T > 0 and P > 0 and world % (T * P) == 0 \
        else None
    micro = p.num_microbatches
    batch = []
    if dp is not None:
        batch = batch_problems(d.global_batch_size, d.micro_batch_size, dp)
        if not batch and micro is None:
            micro = d.global_batch_size // (d.micro_batch_size * dp)
    raw = layout_problems(world_size=world, tensor_parallel_size=T, pipeline_parallel_size=P, zero_stage=p.zero_stage,
                          pipeline_schedule=p.pipeline_schedule, virtual_pipeline_size=p.virtual_pipeline_size,
                          num_microbatches=micro, sequence_parallel=p.sequence_parallel,
                          offload_optimizer=p.offload_optimizer, offload_params=p.offload_params, model=shape)
    out = [_as_key(line, world, t) for line in raw] + batch
    if p.sequence_parallel and isinstance(T, int) and T > 1 and isinstance(d.seq_len, int) and d.seq_len % T:
        out.append(f"data.seq_len={d.seq_len} is not divisible by parallel.tensor_parallel_size={T}: sequence "
                   f"parallelism splits each sequence into {T} shards; use a multiple of {T} or "
                   "parallel.sequence_parallel=false")
    if isinstance(P, int) and P > 1:
        if model is not None and model.tie_embeddings:
            out.append("model.tie_embeddings=true cannot be split into pipeline stages (embedding on the first stage, "
                       "head on the last); set model.tie_embeddings=false or parallel.pipeline_parallel_size=1")
        if str(t.precision) == "16-mixed":
            out.append("trainer.precision='16-mixed' is not supported with pipeline parallelism; use bf16-mixed")
        if p.pipeline_boundaries is not None and model is not None and isinstance(p.virtual_pipeline_size, int):
            stages = P * (2 if p.pipeline_schedule in V_SCHEDULES else p.virtual_pipeline_size)
            out += [f"parallel.{line}" for line in boundary_problems(p.pipeline_boundaries, model.n_layers, stages)]
    return out


def _as_key(line: str, world: int, t: DictConfig) -> str:
    """Name layout problems by their config keys."""
    if line.startswith("world_size="):
        return f"trainer.devices x trainer.num_nodes = {t.devices} x {t.num_nodes}: " + line
    if line.startswith(_PARALLEL_KEYS):
        return "parallel." + line
    return line


def checkpoint_problems(cfg: DictConfig) -> list[str]:
    c = cfg.checkpoint
    out = [] if c.every_n_steps is None else _positive("checkpoint.every_n_steps", c.every_n_steps)
    out += _positive("checkpoint.keep_last", c.keep_last)
    if c.format not in ("universal", "deepspeed"):
        out.append(f"checkpoint.format={c.format!r} is unknown; choose universal or deepspeed")
    if c.resume not in (None, "auto") and not Path(c.resume).is_dir():
        out.append(f"checkpoint.resume={c.resume!r} is not a checkpoint directory; give one, auto, or null")
    if cfg.parallel.timeout_s is not None and not cfg.parallel.timeout_s > 0:
        out.append(f"parallel.timeout_s={cfg.parallel.timeout_s} must be > 0 seconds")
    return out


def launch_problems(cfg: DictConfig) -> list[str]:
    """The cluster choice against how this process was started."""
    launcher = cfg.cluster.launcher
    if launcher == "torchrun" and not {"LOCAL_WORLD_SIZE", "WORLD_SIZE"} <= set(os.environ):
        return ["cluster=torchrun, but this process was not started by torchrun (LOCAL_WORLD_SIZE / WORLD_SIZE are "
                "unset): run it under torchrun, or use cluster=local"]
    if launcher == "slurm" and not ({"SUBMITIT_EXECUTOR", "SLURM_JOB_ID"} & set(os.environ)):
        return ["cluster=slurm submits through Hydra's launcher, which only runs in multirun mode: use "
                "`mgpu-train -m cluster=slurm ...` (or cluster=local to run here)"]
    return []


def config_problems(cfg: DictConfig) -> list[str]:
    """Every problem of a composed ``mgpu-train`` config (empty when it can run)."""
    launch = launch_problems(cfg)
    if launch:  # sizes of torchrun/SLURM jobs come from the launcher's environment; nothing else can be checked
        return launch
    model, out = model_problems(cfg)
    return (out + data_problems(cfg, model) + trainer_problems(cfg) + optim_problems(cfg)
            + parallel_problems(cfg, model) + checkpoint_problems(cfg))
