"""Everything wrong with a composed config, found before any process or process group exists.

``config_problems`` returns one line per problem, each naming the key, its value, the rule and a fix, so
``mgpu-train`` can refuse a bad run in one message instead of failing minutes later inside DeepSpeed or
torch. It only reads the config (and the file system for data paths); it builds no model.
``machine_problems`` adds what this machine lacks to run it (CUDA GPUs, a logger's package), ``memory_problems``
a layout whose estimated peak memory does not fit the GPU or the machine, and ``exit_on_refusal`` turns a refusal
into what the command-line tools print: the problem list, exit status 2.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import glob
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.checkpoint.formats import (
    CheckpointRefusedError,
    CheckpointSettings,
    complete_checkpoints,
    format_name_problems,
    read_refusal,
)
from lightning_mgpu.checkpoint.safe_reader import UnsafeCheckpointError
from lightning_mgpu.data import BYTE_VOCAB_SIZE
from lightning_mgpu.data.batching import batch_problems
from lightning_mgpu.data.manifest import TOKEN_DTYPES as _NUMPY_TOKEN_DTYPES
from lightning_mgpu.layout import (
    V_SCHEDULES,
    ModelShape,
    divisors,
    layout_problems,
    sequence_problems,
    training_loop_problems,
)
from lightning_mgpu.models import LLAMA_SHAPES, LlamaConfig
from lightning_mgpu.models.llama import activation_checkpointing_problems
from lightning_mgpu.models.llama_plan import boundary_problems
from lightning_mgpu.planner.hardware import GPUS
from lightning_mgpu.planner.model_stats import max_rank_parameters
from lightning_mgpu.planner.process import ProcessMemory, host_memory, process_memory
from lightning_mgpu.planner.search import USABLE_MEMORY
from lightning_mgpu.precision import SUPPORTED_PRECISIONS

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCHERS = ("local", "torchrun", "slurm")
DATA_SOURCES = ("corpus", "text", "tokens")
TOKEN_DTYPES = tuple(_NUMPY_TOKEN_DTYPES)
#: trainer.max_time as Lightning's Timer parses it: days:hours:minutes:seconds.
_MAX_TIME = re.compile(r"^\d+:\d+:\d+:\d+$")
_PARALLEL_KEYS = ("world_size", "tensor_parallel_size", "pipeline_parallel_size", "zero_stage", "pipeline_schedule",
                  "context_parallel_size", "tensor*context*pipeline_parallel_size",
                  "virtual_pipeline_size", "num_microbatches", "sequence_parallel", "offload_optimizer",
                  "offload_params", "pipeline_parallel_size*virtual_pipeline_size")


class ConfigError(ValueError):
    """A refused configuration: every problem, one line each (the command-line tools print them and exit 2)."""

    def __init__(self, problems: Sequence[str], what: str = "configuration") -> None:
        self.problems = list(problems)
        super().__init__(f"Invalid {what}:\n" + "\n".join(f"  - {p}" for p in self.problems))


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
    out += activation_checkpointing_problems(m.activation_checkpointing, "model.activation_checkpointing")
    if m.compile:
        from lightning_mgpu.parallel.compile import compile_backend_problems

        out += compile_backend_problems(m.compile_backend, "model.compile_backend")
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
        out += token_source_problems(cfg)
    elif d.source == "text":
        if not d.files:
            out.append("data.files is empty; give glob patterns of .txt/.jsonl files, e.g. 'data.files=[books/*.txt]'")
        for pattern in d.files:
            if not glob.glob(pattern, recursive=True):
                out.append(f"data.files pattern {pattern!r} matches no file")
    if d.get("sources") and d.source != "tokens":
        out.append(f"data.sources is set but data.source={d.source}: blends are of token sources; use data=tokens")
    if not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.01")
    vocabularies, problems = data_vocabularies(cfg)
    out += problems + document_mask_problems(cfg)
    if model is not None:
        if vocabularies:  # the largest one: every id of the data must have an embedding row
            out += vocabulary_problems(cfg, model, *max(vocabularies))
        if isinstance(d.seq_len, int) and d.seq_len > model.max_seq_len:
            out.append(f"data.seq_len={d.seq_len} exceeds the model's max_seq_len={model.max_seq_len}; lower "
                       f"data.seq_len or set model.max_seq_len>={d.seq_len}")
    return out


def token_source_problems(cfg: DictConfig) -> list[str]:
    """``data=tokens``: one ``data.path`` or ``data.sources`` (each a prepared directory or a flat token file, with a
    weight > 0)."""
    from lightning_mgpu.cli.build import data_sources
    from lightning_mgpu.data.blend import weight_problems

    d, out = cfg.data, []
    sources = data_sources(cfg)
    if d.dtype not in TOKEN_DTYPES:
        out.append(f"data.dtype={d.dtype!r} is not a token dtype; choose {' or '.join(TOKEN_DTYPES)}")
    if sources and d.path:
        return out + [f"data.path={d.path!r} and data.sources are both set; give one: data.path for one source, "
                      "data.sources for a blend"]
    if not sources:
        if not d.path:
            return out + ["data.path is not set: data=tokens reads a flat token file or a directory written by "
                          "mgpu-prepare; give data.path=DIR, or a blend: 'data.sources=[{path: DIR1, weight: 0.7}, "
                          "{path: DIR2, weight: 0.3}]'"]
        return out + _token_path_problems("data.path", d.path)
    for i, (path, weight) in enumerate(sources):
        key = f"data.sources[{i}]"
        if not path or path == "???":
            out.append(f"{key} has no path; give each source as {{path: DIR, weight: W}}")
            continue
        out += _token_path_problems(f"{key}.path", path)
        out += weight_problems([weight], [f"{key} ({path})"])
    return out


def document_mask_problems(cfg: DictConfig) -> list[str]:
    """``data.document_mask=true`` needs tokens with an end-of-document id (a prepared directory's manifest, or a
    tokenizer that has one; not bytes), the same in every prepared source."""
    if not cfg.data.get("document_mask"):
        return []
    from lightning_mgpu.cli.build import run_eod_token_id, token_paths
    from lightning_mgpu.data.manifest import PreparedDataError, is_prepared, read_manifest

    eod, origin = run_eod_token_id(cfg)
    if eod is None:
        return [f"data.document_mask=true needs tokens that end every document with an end-of-document id, but "
                f"{origin}; prepare the data with mgpu-prepare (data=tokens data.path=DIR), or give "
                "data.tokenizer=PATH of a tokenizer with an end-of-document token, or set data.document_mask=false"]
    out = []
    for path in token_paths(cfg):
        if not is_prepared(path):
            continue
        try:
            manifest = read_manifest(path)
        except PreparedDataError:  # named by token_source_problems
            continue
        if manifest.eod_id != eod:
            out.append(f"data.document_mask=true: {path} ends documents with id {manifest.eod_id} "
                       f"({manifest.eod_token!r}), but {origin} says {eod}; prepare every source with the same "
                       "--eod-token")
    return out


def _token_path_problems(key: str, path: str) -> list[str]:
    from lightning_mgpu.data.manifest import PreparedDataError, read_manifest

    if Path(path).is_dir():
        try:
            read_manifest(path)
        except PreparedDataError as err:
            return [f"{key}: {err}"]
        return []
    if not Path(path).is_file():
        return [f"{key}={path!r} does not exist; give a directory written by mgpu-prepare or a token file "
                "(data=tokens)"]
    return []


#: (vocabulary size, what has it) of the data, e.g. (256, "the 256 byte tokens of data.source=corpus").
Vocabulary = tuple[int, str]


def data_vocabularies(cfg: DictConfig) -> tuple[list[Vocabulary], list[str]]:
    """(the vocabularies the data's token ids come from, problems with the tokenizer and the prepared tokens).

    Byte tokens when no tokenizer is given (corpus, text); the run's tokenizer; every prepared directory's manifest,
    whose tokenizer must be the run's. A flat token file says nothing about its ids.
    """
    from lightning_mgpu.cli.build import run_tokenizer, token_paths
    from lightning_mgpu.data.manifest import PreparedDataError, read_manifest, tokenizer_match_problems
    from lightning_mgpu.data.tokenizer import Tokenizer, TokenizerError

    out: list[Vocabulary] = []
    problems: list[str] = []
    found = run_tokenizer(cfg)
    sha, name = None, ""
    if found is not None:
        path, name = found
        try:
            tok = Tokenizer(path)
            sha = tok.sha256
            out.append((tok.vocab_size, f"the {tok.vocab_size:,} token ids of {name}"))
        except TokenizerError as err:
            problems.append(f"{name}: {err}")
    elif cfg.data.source in ("corpus", "text"):
        out.append((BYTE_VOCAB_SIZE, f"the {BYTE_VOCAB_SIZE} byte tokens of data.source={cfg.data.source}"))
    prepared = []
    for path in token_paths(cfg):
        if Path(path).is_dir():
            try:
                manifest = read_manifest(path)
            except PreparedDataError:  # named by token_source_problems
                continue
            prepared.append((path, manifest))
            out.append((manifest.vocab_size, f"the {manifest.vocab_size:,} token ids of the tokenizer {path} was "
                                             f"prepared with"))
    return out, problems + tokenizer_match_problems(prepared, sha, name)


def vocabulary_problems(cfg: DictConfig, model: LlamaConfig, size: int, what: str) -> list[str]:
    """The rule for bytes and tokenizers alike: the data's largest token id (``size - 1``) must fit
    ``model.vocab_size``."""
    if model.vocab_size >= size:
        return []
    if cfg.model.init_from:
        return [f"the vocab_size={model.vocab_size} of model.init_from={cfg.model.init_from!r} (its config.json) is "
                f"smaller than {what}: ids up to {size - 1} have no embedding row; use the tokenizer that came with "
                "the checkpoint (data.tokenizer, or the tokenizer.json beside its weights)"]
    return [f"model.vocab_size={model.vocab_size} is smaller than {what}: ids up to {size - 1} have no embedding row; "
            f"set model.vocab_size>={size}"]


def trainer_problems(cfg: DictConfig) -> list[str]:
    t = cfg.trainer
    out = _positive("trainer.devices", t.devices) + _positive("trainer.num_nodes", t.num_nodes)
    out += _positive("trainer.max_steps", t.max_steps) + _positive("trainer.log_every_n_steps", t.log_every_n_steps)
    out += _positive("trainer.accumulate_grad_batches", t.accumulate_grad_batches)
    for key in ("val_check_interval", "max_epochs", "limit_train_batches", "check_val_every_n_epoch"):
        if t[key] is not None:
            out += _positive(f"trainer.{key}", t[key])
    if t.accelerator not in ACCELERATORS:
        out.append(f"trainer.accelerator={t.accelerator!r} is unknown; choose one of {', '.join(ACCELERATORS)}")
    if str(t.precision) not in SUPPORTED_PRECISIONS:
        out.append(f"trainer.precision={t.precision!r} is not supported; choose one of {', '.join(SUPPORTED_PRECISIONS)}")
    if t.gradient_clip_val is not None and t.gradient_clip_val < 0:
        out.append(f"trainer.gradient_clip_val={t.gradient_clip_val} must be >= 0 (or null for no clipping)")
    if t.max_time is not None and not _MAX_TIME.match(str(t.max_time)):
        out.append(f"trainer.max_time={t.max_time!r} must be days:hours:minutes:seconds, e.g. 00:12:00:00 for 12 "
                   "hours")
    if t.limit_val_batches < 0 or (t.limit_val_batches > 1 and not float(t.limit_val_batches).is_integer()):
        out.append(f"trainer.limit_val_batches={t.limit_val_batches} must be a fraction in [0, 1] of the validation "
                   "batches or a whole number of batches, e.g. 0.5 or 2")
    if isinstance(t.num_sanity_val_steps, int) and t.num_sanity_val_steps < -1:
        out.append(f"trainer.num_sanity_val_steps={t.num_sanity_val_steps} must be >= 0 (or -1 for every validation "
                   "batch)")
    if t.limit_train_batches is None:  # one endless epoch: nothing that waits for an epoch's end would ever happen
        for key in ("max_epochs", "check_val_every_n_epoch"):
            if t[key] is not None:
                out.append(f"trainer.{key}={t[key]} never happens: the training stream is endless (one epoch that "
                           "never ends); set trainer.limit_train_batches=N to make epochs of N batches, or use "
                           + ("trainer.max_steps" if key == "max_epochs" else "trainer.val_check_interval (steps)"))
    elif (t.check_val_every_n_epoch is not None and isinstance(t.val_check_interval, int)
          and isinstance(t.limit_train_batches, int) and t.val_check_interval > t.limit_train_batches):
        out.append(f"trainer.val_check_interval={t.val_check_interval} is longer than an epoch "
                   f"(trainer.limit_train_batches={t.limit_train_batches}) while trainer.check_val_every_n_epoch is "
                   "set; lower it, or set trainer.check_val_every_n_epoch=null to count it over the whole run")
    if cfg.cluster.launcher not in LAUNCHERS:
        out.append(f"cluster.launcher={cfg.cluster.launcher!r} is unknown; choose cluster=local, torchrun or slurm")
    return out


def logger_problems(cfg: DictConfig) -> list[str]:
    csv = cfg.logger.csv
    if csv is not None and csv.flush_logs_every_n_steps is not None:
        return _positive("logger.csv.flush_logs_every_n_steps", csv.flush_logs_every_n_steps)
    return []


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
    T, P, C = p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size
    sizes = (T, P, C)
    dp = world // (T * P * C) if all(isinstance(n, int) and n > 0 for n in sizes) and world % (T * P * C) == 0 \
        else None
    micro = p.num_microbatches
    batch = []
    if dp is not None:
        batch = batch_problems(d.global_batch_size, d.micro_batch_size, dp)
        if not batch and micro is None:
            micro = d.global_batch_size // (d.micro_batch_size * dp)
    raw = layout_problems(world_size=world, tensor_parallel_size=T, pipeline_parallel_size=P, zero_stage=p.zero_stage,
                          pipeline_schedule=p.pipeline_schedule, virtual_pipeline_size=p.virtual_pipeline_size,
                          num_microbatches=micro, sequence_parallel=p.sequence_parallel, context_parallel_size=C,
                          offload_optimizer=p.offload_optimizer, offload_params=p.offload_params, model=shape)
    out = [_as_key(line, world, t) for line in raw] + batch
    if isinstance(T, int) and isinstance(C, int) and T > 0 and C > 0 and isinstance(d.seq_len, int):
        out += sequence_problems(d.seq_len, C, T, bool(p.sequence_parallel), key="data.seq_len")
    if cfg.model.compile and isinstance(p.zero_stage, int):
        from lightning_mgpu.parallel.compile import compile_layout_problems

        out += compile_layout_problems(p.zero_stage, key="model.compile")
    if isinstance(C, int) and C > 1 and d.get("document_mask"):
        out.append(f"parallel.context_parallel_size={C} does not support data.document_mask=true yet (each rank would "
                   "need the document boundaries of the chunks it does not hold); set one of them off")
    if isinstance(P, int) and isinstance(t.accumulate_grad_batches, int):
        out += [f"trainer.{line}" for line in training_loop_problems(P, t.accumulate_grad_batches)]
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
    out += format_name_problems(c.format, "checkpoint.format")
    if c.resume not in (None, "auto") and not Path(c.resume).is_dir():
        out.append(f"checkpoint.resume={c.resume!r} is not a checkpoint directory; give one, auto, or null")
    elif c.resume not in (None, "auto") and not complete_checkpoints(c.resume):
        settings = CheckpointSettings(c.format, c.trust_deepspeed_checkpoints)
        if (refusal := read_refusal(c.resume, settings)) is not None:
            out.append(f"checkpoint.resume: {refusal}")
    if cfg.parallel.timeout_s is not None and not cfg.parallel.timeout_s > 0:
        out.append(f"parallel.timeout_s={cfg.parallel.timeout_s} must be > 0 seconds")
    return out


def launch_problems(cfg: DictConfig) -> list[str]:
    """The cluster choice against how this process was started."""
    launcher = cfg.cluster.launcher
    if launcher == "torchrun" and not {"LOCAL_WORLD_SIZE", "WORLD_SIZE"} <= set(os.environ):
        return ["cluster=torchrun, but this process was not started by torchrun (LOCAL_WORLD_SIZE / WORLD_SIZE are "
                "unset): run it under torchrun, or use cluster=local"]
    if launcher == "slurm" and not _inside_slurm_job():
        return ["cluster=slurm submits through Hydra's launcher, which only runs in multirun mode: use "
                "`mgpu-train -m cluster=slurm ...` (or cluster=local to run here)"]
    return []


def _inside_slurm_job() -> bool:
    return bool({"SUBMITIT_EXECUTOR", "SLURM_JOB_ID"} & set(os.environ))


def key_problems(cfg: DictConfig) -> list[str]:
    """Keys left ``???`` and keys added with ``+`` that no schema has (they would be ignored)."""
    return _key_problems(cfg, "")


def _key_problems(node: DictConfig, prefix: str) -> list[str]:
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    out = []
    for key, value in node.items_ex(resolve=False):  # unresolved: a ${...} of an unset variable must not raise here
        path = f"{prefix}{key}"
        if known is not None and key not in known and path != "hydra":  # hydra: Hydra's own node, when composed in
            out.append(f"{path} is not a setting" + (did_you_mean(str(key), known, prefix) or "; remove it"))
        elif OmegaConf.is_missing(node, key):
            out.append(f"{path} is required and has no value: add {path}=... to the command line")
        elif (isinstance(value, DictConfig) and not OmegaConf.is_interpolation(node, key)
              and node[key] is not None):
            out += _key_problems(value, f"{path}.")
    return out


def did_you_mean(key: str, known, prefix: str = "") -> str:
    """``"; did you mean trainer.max_steps?"`` for the closest names, or nothing."""
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""


def config_problems(cfg: DictConfig, launching: bool = True) -> list[str]:
    """Every problem of a composed ``mgpu-train`` config itself (empty when it can run on suitable machines).

    What this machine lacks to run it is :func:`machine_problems`; :func:`check_run` asks both. With
    ``launching=False`` (the dry run, which starts nothing) how the job would be launched is not checked.
    """
    keys = key_problems(cfg)
    if keys:  # reading a ??? value raises, and an unknown key means the rest was not what the user meant
        return keys
    launch = launch_problems(cfg) if launching else []
    if launch:  # sizes of torchrun/SLURM jobs come from the launcher's environment; nothing else can be checked
        return launch
    model, out = model_problems(cfg)
    return (out + data_problems(cfg, model) + trainer_problems(cfg) + logger_problems(cfg) + optim_problems(cfg)
            + parallel_problems(cfg, model) + checkpoint_problems(cfg))


def plan_problems(cfg: DictConfig) -> list[str]:
    """Every problem of a composed ``mgpu-plan`` config: the model, the cluster size, the batch and ``plan.*``."""
    keys = key_problems(cfg)
    if keys:
        return keys
    _, out = model_problems(cfg)
    t, d, plan = cfg.trainer, cfg.data, cfg.plan
    out += _positive("trainer.devices", t.devices) + _positive("trainer.num_nodes", t.num_nodes)
    out += _positive("data.seq_len", d.seq_len) + _positive("data.global_batch_size", d.global_batch_size)
    if plan.gpu not in GPUS:
        out.append(f"plan.gpu={plan.gpu!r} is unknown; choose one of {', '.join(GPUS)}"
                   + did_you_mean(str(plan.gpu), GPUS))
    if plan.achievable is not None and not 0.0 < plan.achievable <= 1.0:
        out.append(f"plan.achievable={plan.achievable} must be a fraction of the peak in (0, 1], e.g. 0.5")
    return out + _positive("plan.top", plan.top) + _positive("plan.commands", plan.commands, allow_zero=True)


#: logger option -> (modules of which one must import, the extra of lightning_mgpu that installs one)
LOGGER_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
                   "wandb": (("wandb",), "wandb"), "mlflow": (("mlflow",), "mlflow")}


def machine_problems(cfg: DictConfig) -> list[str]:
    """What this machine lacks to run ``cfg`` here: visible CUDA GPUs, a selected logger's package.

    Not asked when submitting to SLURM (the job runs on other machines), and asked again inside the job.
    """
    if cfg.cluster.launcher == "slurm" and not _inside_slurm_job():
        return []
    out = []
    for name, (modules, extra) in LOGGER_PACKAGES.items():
        if cfg.logger[name] is not None and not any(_importable(m) for m in modules):
            out.append(f"logger={name} needs the {' or '.join(modules)} package, which is not installed: "
                       f"pip install 'lightning_mgpu[{extra}]' (or choose another logger, e.g. logger=csv)")
    return out + gpu_problems(cfg.trainer.accelerator, cfg.trainer.devices)


def gpu_problems(accelerator: str, devices: int) -> list[str]:
    """A GPU trainer needs ``devices`` visible CUDA GPUs on each node (``accelerator=auto`` takes them when any are
    visible)."""
    import torch

    visible = torch.cuda.device_count()
    if not _wants_gpu(accelerator, visible) or not isinstance(devices, int) or devices <= visible:
        return []
    where = f"this machine has {visible} (torch.cuda.device_count()"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        where += f" with CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
    if torch.version.cuda is None:
        where += f"; torch {torch.__version__} is a build without CUDA"
    fix = "use trainer=cpu" if visible == 0 else f"use trainer.devices={visible} (or fewer), or trainer=cpu"
    return [f"trainer.devices={devices} with trainer.accelerator={accelerator} needs {devices} visible CUDA "
            f"GPU{'s' if devices > 1 else ''}; {where}); {fix}"]


def _wants_gpu(accelerator: str, visible: int) -> bool:
    """Whether a trainer runs on GPUs: ``gpu``/``cuda``, or ``auto`` where any are visible."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and visible > 0)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_run(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every reason ``cfg`` cannot run here, before anything starts.

    Memory is estimated only for a configuration without other problems (it needs a valid layout and a machine
    that can run it).
    """
    problems = config_problems(cfg)
    if not (key_problems(cfg) or launch_problems(cfg)):  # else the sizes cannot be read
        problems += machine_problems(cfg)
    if not problems:
        problems = memory_problems(cfg)
    if problems:
        raise ConfigError(problems)


# ------------------------------------------------------------------------------------------------------ memory
GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The memory a run's processes share: one GPU's, or on CPU one machine's for its ``trainer.devices`` processes."""

    total: float  #: bytes
    usable: float  #: the share an estimate may fill (the planner's USABLE_MEMORY: the rest is the OS, fragmentation)
    processes: int  #: processes that share it
    on_gpu: bool
    name: str  #: where the figure comes from, for messages


def memory_budget(cfg: DictConfig) -> Optional[MemoryBudget]:
    """On GPUs, the memory of the GPU this process will use (or of ``plan.gpu``'s preset where no GPU is visible, as
    at SLURM submission); on CPU, this machine's memory, shared by the ``trainer.devices`` processes it runs. None
    where it cannot be known here: a CPU job submitted to SLURM (it checks again inside the job)."""
    import torch

    visible = torch.cuda.device_count()
    if _wants_gpu(cfg.trainer.accelerator, visible):
        if visible:
            index = int(os.environ.get("LOCAL_RANK", "0")) % visible  # this process's own GPU: no context elsewhere
            props = torch.cuda.get_device_properties(index)
            total, name = float(props.total_memory), f"the {props.name} (cuda:{index})"
        elif cfg.plan.gpu in GPUS:
            gpu = GPUS[cfg.plan.gpu]
            total, name = gpu.memory_bytes, f"a {gpu.name} (plan.gpu={cfg.plan.gpu}; no GPU is visible here)"
        else:
            return None
        return MemoryBudget(total, USABLE_MEMORY * total, 1, True, name)
    if cfg.cluster.launcher == "slurm" and not _inside_slurm_job():
        return None
    total, name = host_memory()
    return MemoryBudget(total, USABLE_MEMORY * total, cfg.trainer.devices, False, name)


def builds_whole_model() -> bool:
    """Whether every rank of ``mgpu-train`` builds the whole model before keeping its shard (see
    :func:`lightning_mgpu.contract.builds_on_meta`)."""
    from lightning_mgpu.contract import builds_on_meta
    from lightning_mgpu.module import LLMModule

    return not builds_on_meta(LLMModule)


def run_memory(cfg: DictConfig, model: LlamaConfig, on_gpu: bool) -> ProcessMemory:
    """Peak memory of one process of ``cfg`` (its fullest rank), as
    :func:`lightning_mgpu.planner.process.process_memory` estimates it: on its GPU, or in host memory on CPU."""
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    tp, pp, cp = p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size
    dp = t.devices * t.num_nodes // (tp * pp * cp)
    return process_memory(model, d.seq_len, d.micro_batch_size, tp, pp, dp,
                          p.zero_stage, 2 if p.pipeline_schedule in V_SCHEDULES else p.virtual_pipeline_size,
                          p.sequence_parallel, model.activation_checkpointing == "full", str(t.precision),
                          host=not on_gpu, builds_whole_model=builds_whole_model(),
                          offload_optimizer=p.offload_optimizer is not None,
                          offload_params=p.offload_params is not None, context=cp,
                          mode=model.activation_checkpointing, schedule=p.pipeline_schedule,
                          boundaries=p.pipeline_boundaries,
                          microbatches=max(1, d.global_batch_size // (d.micro_batch_size * max(1, dp))))


def memory_problems(cfg: DictConfig) -> list[str]:
    """A layout whose estimated peak memory does not fit, refused before any process starts, with the estimate, the
    limit and the cheapest changes that fit. ``trainer.check_memory=false`` turns the check off."""
    if not cfg.trainer.check_memory:
        return []
    budget = memory_budget(cfg)
    if budget is None:
        return []
    from lightning_mgpu.cli.build import build_model_config

    model = build_model_config(cfg)
    need = run_memory(cfg, model, budget.on_gpu)
    if budget.processes * need.total <= budget.usable:
        return []
    return [_memory_refusal(cfg, model, need, budget)]


def _memory_refusal(cfg: DictConfig, model: LlamaConfig, need: ProcessMemory, budget: MemoryBudget) -> str:
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    n = budget.processes
    limit = f"the {budget.usable / GB:.1f} GB usable of the {budget.total / GB:.1f} GB of {budget.name}"
    if budget.on_gpu:
        lines = [f"memory: an estimated peak of {need.total / GB:.1f} GB per GPU is more than {limit}"]
    else:
        lines = [f"memory: trainer.devices={n} process{'es' if n > 1 else ''} on this machine x an estimated peak "
                 f"of {need.total / GB:.1f} GB each = {n * need.total / GB:.1f} GB is more than {limit}"]
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    dp = t.devices * t.num_nodes // (tp * pp)  # the ranks ZeRO partitions over: data x context
    stages = 2 if p.pipeline_schedule in V_SCHEDULES else p.virtual_pipeline_size
    held = max_rank_parameters(model, tp, pp, stages)
    parts = [f"{need.baseline / GB:.1f} GB libraries"] if need.baseline else []
    states = "model states" if budget.on_gpu else "model states at the first optimizer step's peak"
    parts += [f"{need.model_states / GB:.1f} GB {states} ({held / 1e6:,.0f}M parameters on the fullest rank, "
              f"{t.precision}, ZeRO-{p.zero_stage} over {dp} data-parallel rank{'s' if dp > 1 else ''})",
              f"{need.activations / GB:.1f} GB activations (micro-batch {d.micro_batch_size} x {d.seq_len} tokens)"]
    breakdown = f"per {'GPU' if budget.on_gpu else 'process'}: " + " + ".join(parts)
    if need.whole_model:
        held = ("the whole model" if builds_whole_model() else "its largest tensor whole (ZeRO-3 partitions each as it is "
                "filled)" if p.zero_stage == 3 else "its tensor/pipeline shard whole")
        breakdown += f"; before that, every rank builds {held}: {need.whole_model / GB:.1f} GB"
    lines.append(breakdown)
    fits, together = _memory_fixes(cfg, budget)
    unit = "per GPU" if budget.on_gpu else "per machine"
    if fits:
        lines.append("fixes, cheapest first: "
                     + "; ".join(f"{_overrides(change)} ({after / GB:.1f} GB {unit})" for change, after in fits))
    elif together is not None:
        lines.append(f"no single change fits; together: {_overrides(together[0])} ({together[1] / GB:.1f} GB {unit})")
    else:
        alone = need.baseline + need.whole_model
        copy = "whole-model copy" if builds_whole_model() else "unpartitioned shard" if p.zero_stage != 3 else "largest tensor"
        why = (f"the {copy} alone needs {alone / GB:.1f} GB {'per GPU' if budget.on_gpu else 'per process'}"
               if budget.processes * alone > budget.usable else "")
        lines.append("no change of ZeRO stage, activation checkpointing, micro-batch, tensor/pipeline parallelism or "
                     f"processes per machine fits{': ' + why if why else ''}; use "
                     + ("GPUs with more memory, more GPUs" if budget.on_gpu else "a machine with more memory, more "
                        "machines") + " (trainer.num_nodes) or a smaller model")
    lines.append("trainer.check_memory=false launches it anyway")
    return "\n    ".join(lines)


def _overrides(overrides: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in overrides.items())


Fix = tuple[dict, float]  # (overrides, estimated bytes per GPU, or per machine on CPU)


def _memory_fixes(cfg: DictConfig, budget: MemoryBudget) -> tuple[list[Fix], Optional[Fix]]:
    """(single changes that fit: each kind's mildest setting that does, cheapest kind first; when none does, changes
    of several kinds that fit together, or None).

    Together: kind by kind, the mildest setting that makes the run fit, else the one that saves most; then every
    kind whose change is not needed for the run to fit is left out again.
    """
    kinds = _fix_kinds(cfg, budget)
    fits = []
    for kind in kinds:
        for overrides in kind:
            need = _need_with(cfg, overrides, budget)
            if need is not None and need <= budget.usable:
                fits.append((overrides, need))
                break
    if fits:
        return fits, None
    chosen: list[dict] = []
    best = _need_with(cfg, {}, budget)
    for kind in kinds:
        tried = [(need, overrides) for overrides in kind
                 if (need := _need_with(cfg, _merged(*chosen, overrides), budget)) is not None]
        fitting = [(need, overrides) for need, overrides in tried if need <= budget.usable]
        need, overrides = fitting[0] if fitting else min(tried, key=lambda pair: pair[0], default=(best, {}))
        if overrides and need < best:
            chosen.append(overrides)
            best = need
        if best <= budget.usable:
            for change in list(chosen[:-1]):  # drop what the fit does not need
                rest = [c for c in chosen if c is not change]
                need = _need_with(cfg, _merged(*rest), budget)
                if need is not None and need <= budget.usable:
                    chosen, best = rest, need
            return [], (_merged(*chosen), best)
    return [], None


def _merged(*overrides: dict) -> dict:
    return {key: value for change in overrides for key, value in change.items()}


def _fix_kinds(cfg: DictConfig, budget: MemoryBudget) -> list[list[dict]]:
    """The changes that lower memory, by kind (cheapest kind first), each kind's settings mildest first."""
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    world = t.devices * t.num_nodes
    kinds = [[{"parallel.zero_stage": z} for z in range(p.zero_stage + 1, 4)],
             [{"model.activation_checkpointing": "full"}] if cfg.model.activation_checkpointing != "full" else [],
             [{"data.micro_batch_size": m} for m in reversed(divisors(d.micro_batch_size)) if m < d.micro_batch_size],
             [{"parallel.tensor_parallel_size": n} for n in divisors(t.devices) if n > p.tensor_parallel_size],
             [{"parallel.pipeline_parallel_size": n} for n in divisors(world // p.tensor_parallel_size)
              if n > p.pipeline_parallel_size],
             [{"parallel.context_parallel_size": n} for n in divisors(t.devices // p.tensor_parallel_size)
              if n > p.context_parallel_size]]  # a split the sequence does not allow is dropped by _need_with
    fewer = [n for n in reversed(divisors(t.devices)) if n < t.devices]
    if budget.on_gpu:
        if p.offload_optimizer is None:
            kinds.append([{"parallel.zero_stage": max(1, p.zero_stage), "parallel.offload_optimizer": "cpu"}])
    else:  # fewer processes per machine: the same layout over more machines, or fewer processes in all
        kinds.append([{"trainer.devices": n, "trainer.num_nodes": t.num_nodes * t.devices // n} for n in fewer])
        kinds.append([{"trainer.devices": n} for n in fewer])
    return [kind for kind in kinds if kind]


def _need_with(cfg: DictConfig, overrides: dict, budget: MemoryBudget) -> Optional[float]:
    """Estimated bytes per GPU (CPU: per machine) of ``cfg`` changed by ``overrides``; None if that breaks a rule."""
    changed = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(changed, key, value, merge=False)
    model, problems = model_problems(changed)
    if problems or model is None or parallel_problems(changed, model):
        return None
    return (1 if budget.on_gpu else changed.trainer.devices) * run_memory(changed, model, budget.on_gpu).total


# ------------------------------------------------------------------------------------------ command-line tools
#: Exit status of a refused configuration or command line (as argparse uses for a bad command line).
EXIT_REFUSED = 2
#: Set to 1 to see the traceback behind a refused configuration (Hydra's own switch for its errors).
FULL_ERROR = "HYDRA_FULL_ERROR"


_reporting = False  # True while exit_on_refusal runs an entry point and the user did not ask for tracebacks


def exit_on_refusal(entry: Callable[[], object]) -> None:
    """Run a console entry point: a refused configuration or command line prints only its problems on stderr and
    exits with status 2; any other error keeps its traceback. ``HYDRA_FULL_ERROR=1`` shows every traceback."""
    global _reporting
    if os.environ.get(FULL_ERROR) == "1":
        entry()
        return
    os.environ[FULL_ERROR] = "1"  # Hydra then raises its composition errors instead of printing them and exiting 1
    _reporting = True
    try:
        entry()
    except Exception as err:
        message = refusal_message(err)
        if message is None:
            raise
        _refuse(message)
    finally:
        os.environ.pop(FULL_ERROR, None)
        _reporting = False


@contextlib.contextmanager
def refusal_exits() -> Iterator[None]:
    """Around the body of a Hydra task function: a :class:`ConfigError` exits at once, before Hydra reports a failed
    job ("Error executing job with overrides ...") and re-raises it."""
    try:
        yield
    except ConfigError as err:
        if not _reporting:
            raise
        _refuse(str(err))


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(message + "\n")
    raise SystemExit(EXIT_REFUSED) from None


def refusal_message(err: BaseException) -> Optional[str]:
    """What to tell a user whose configuration or command line was refused; None for any other error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(err, (ConfigError, CheckpointRefusedError, UnsafeCheckpointError)):
        return str(err)
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        options = list(err.options or group_options(group))
        line = f"{group}={name} is not an option of {group}"
        if options:
            line += f"; choose one of {', '.join(options)}{did_you_mean(name, options)}"
        return f"Invalid command line:\n  - {line}"
    if isinstance(err, OverrideParseException):
        why = "; ".join(line.strip() for line in err.message.splitlines()
                        if line.strip() not in ("", "^") and not line.startswith(("Error parsing", "See ")))
        return (f"Invalid command line:\n  - {err.override!r} is not an override: {why}\n"
                "(overrides are key=value, e.g. trainer.devices=2 or model=tiny; --help lists the options)")
    if isinstance(err, ConfigCompositionException):
        cause = err.__cause__
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            parent = cause.full_key.rsplit(".", 1)[0] + "." if "." in cause.full_key else ""
            hint = did_you_mean(str(cause.key), _fields(cause.object_type), parent)
            return f"Invalid command line:\n  - {cause.full_key} is not a setting{hint}"
        if isinstance(cause, ValidationError) and cause.full_key:
            return f"Invalid command line:\n  - {cause.full_key}: {cause.msg.splitlines()[0]}"
        detail = f": {cause}" if isinstance(cause, OmegaConfBaseException) else ""
        return f"Invalid command line:\n  - {err}{detail}"
    if isinstance(err, AssertionError) and "Unexpected type for root: NoneType" in str(err):
        # OmegaConf's update of a key below a null node, e.g. logger.wandb.project=x while logger=wandb is not selected
        return ("Invalid command line:\n  - a key is set inside a config node that is null: select its option first "
                "(logger.wandb.project=x needs logger=wandb or logger=[csv,wandb]), or give the whole node")
    return None


def _fields(schema) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def group_options(group: str) -> list[str]:
    """The options of a config group of ``conf/`` (or the recipes), by name."""
    from lightning_mgpu.cli.paths import conf_dir, recipes_dir

    folder = recipes_dir() if group == "recipe" else conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))
