"""The config's own rules, group by group, before any process or process group exists: ``config_problems`` returns
one line per problem, each naming the key, its value, the rule and a fix, so ``mgpu-train`` refuses a bad run in one
message instead of failing minutes later inside DeepSpeed or torch. They read the config and the run's resolved data
(:class:`~lightning_mgpu.cli.run_data.RunData`); they build no model. ``lightning_mgpu.cli.spec.resolve_run`` asks
them all; ``plan_problems`` does the same for ``mgpu-plan``."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.checkpoint.formats import (CheckpointSettings, complete_checkpoints, format_name_problems,
                                               read_refusal, replica_checkpoint_problems, background_save_problems,
                                               expert_checkpoint_problems)
from lightning_mgpu.cli.data_rules import data_problems, seq_len_problems
from lightning_mgpu.cli.errors import did_you_mean
from lightning_mgpu.cli.layout_rules import parallel_problems
from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.resilience.faulty_hosts import exclusion_problems
from lightning_mgpu.resilience.restarts import restart_problems
from lightning_mgpu.cli.run_data import RunData, resolve_data, unread_data
from lightning_mgpu.cli.run_model import resolve_model
from lightning_mgpu.cli.rule_base import ACCELERATORS, LAUNCHERS, _MAX_TIME, _positive, keyed
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.module import lr_scaling_problems
from lightning_mgpu.planner.hardware import GPUS
from lightning_mgpu.optim.choice import NS_DTYPES, OPTIMIZERS
from lightning_mgpu.optim.muon import muon_offload_problem
from lightning_mgpu.precision import SUPPORTED_PRECISIONS, fp8_problems
from lightning_mgpu.resilience.step_guard import SpikeRule
from lightning_mgpu.split_rules import steps_apart


def model_problems(cfg: DictConfig, data: RunData) -> tuple[Optional[LlamaConfig], list[str]]:
    """(the model config when it can be built, its problems)."""
    out = model_source(cfg).problems()
    if out:
        return None, out
    try:
        return resolve_model(cfg, data), []
    except ValueError as err:  # LlamaConfig lists its own rules (head_dim, heads vs kv heads, ...)
        return None, [f"model: {line.strip(' -')}" for line in str(err).splitlines()[1:]]


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
    out += keyed(fp8_problems(t.fp8), t)
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
    out += restart_problems(cfg.cluster.max_restarts, cfg.cluster.launcher, cfg.checkpoint.resume,
                            cfg.checkpoint.every_n_steps)
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
    if o.name not in OPTIMIZERS:
        out.append(f"optim.name={o.name!r} is unknown; choose {' or '.join(OPTIMIZERS)} (optim=muon selects Muon)")
    if o.muon_ns_dtype not in NS_DTYPES:
        out.append(f"optim.muon_ns_dtype={o.muon_ns_dtype!r} is unknown; choose {', '.join(NS_DTYPES)}")
    if not 0.0 <= o.muon_momentum < 1.0:
        out.append(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95")
    if o.name == "muon" and cfg.parallel.offload_optimizer is not None:
        out.append(muon_offload_problem(cfg.parallel.offload_optimizer, "parallel.offload_optimizer"))
    return out + lr_scaling_problems(o.lr_scaling, o.reference_batch_size)


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
    if c.async_save:
        out += background_save_problems(c.format)
    if c.every_n_steps or c.save_last or c.resume:
        out += replica_checkpoint_problems(cfg.parallel.replica_update, c.format)
        out += expert_checkpoint_problems(cfg.parallel.expert_parallel_size, c.format)
    if cfg.parallel.timeout is not None and not cfg.parallel.timeout > 0:
        out.append(f"parallel.timeout={cfg.parallel.timeout} must be > 0 seconds")
    return out


def profile_problems(cfg: DictConfig) -> list[str]:
    """``profile.steps``: steps this run trains, 0 to ``trainer.max_steps - 1``; ``profile.largest_tensors``."""
    p, max_steps = cfg.profile, cfg.trainer.max_steps
    steps = list(p.steps)
    known = isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps >= 1  # else its own rule
    outside = [s for s in steps if s < 0 or (known and s >= max_steps)]
    out = []
    if outside:
        trains = f"steps 0 to {max_steps - 1} (trainer.max_steps={max_steps})" if known else "steps from 0"
        out.append(f"profile.steps={steps}: {', '.join(map(str, outside))} "
                   f"{'is not a step' if len(outside) == 1 else 'are not steps'} of this run, which trains {trains}, "
                   "counted from 0 as metrics.csv counts them; choose steps in that range"
                   + (", or raise trainer.max_steps" if known else ""))
    return out + _positive("profile.largest_tensors", p.largest_tensors, allow_zero=True)


def bad_steps_problems(cfg: DictConfig) -> list[str]:
    """``bad_steps.loss_spike.*``: the rule :class:`lightning_mgpu.resilience.SpikeRule` states;
    ``bad_steps.rollback_*``: a count within a window of skipped steps; ``sdc.*``: a positive interval, copies to
    compare (ZeRO-3 keeps none) and a checkpoint kept from before the last check."""
    spike, every, bad = cfg.bad_steps.loss_spike, cfg.sdc.every_n_steps, cfg.bad_steps
    out = [] if spike is None else SpikeRule(**spike).problems("bad_steps.loss_spike.")
    if bad.rollback_after is not None:
        out += _positive("bad_steps.rollback_after", bad.rollback_after)
        if isinstance(bad.rollback_after, int) and bad.rollback_window < bad.rollback_after:
            out.append(f"bad_steps.rollback_window={bad.rollback_window} must be >= bad_steps.rollback_after="
                       f"{bad.rollback_after} (the steps in which that many skips roll back)")
        if not bad.skip:
            out.append("bad_steps.rollback_after counts skipped steps, and bad_steps.skip=false skips none: set "
                       "bad_steps.skip=true or bad_steps.rollback_after=null")
    if every is not None:
        out += _positive("sdc.every_n_steps", every)
        if cfg.parallel.zero_stage == 3:
            out.append("sdc.every_n_steps compares the ranks' copies of the weights, and parallel.zero_stage=3 keeps "
                       "none (each rank holds a different partition): use zero_stage 0-2, or sdc.every_n_steps=null")
        c = cfg.checkpoint
        # set aside: the checkpoints of the steps since the last check, and of the step that found it (it runs)
        needed = -(-every // c.every_n_steps) + 2 if isinstance(every, int) and every > 0 and c.every_n_steps else 0
        if c.keep_last < needed:
            out.append(f"sdc.every_n_steps={every} with checkpoint.every_n_steps={c.every_n_steps} needs "
                       f"checkpoint.keep_last >= {needed} (it is {c.keep_last}): a corruption found sets aside the "
                       "checkpoints since the last check and the one of the step that found it, and one from before "
                       "must still be kept")
    return out + exclusion_problems(cfg.sdc.exclude_faulty_hosts, cfg.sdc.max_excluded_nodes, cfg.cluster.launcher,
                                    every)


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
        elif _could_be_missing(value) and OmegaConf.is_missing(node, key):
            out.append(f"{path} is required and has no value: add {path}=... to the command line")
        elif (isinstance(value, DictConfig) and not OmegaConf.is_interpolation(node, key)
              and node[key] is not None):
            out += _key_problems(value, f"{path}.")
    return out


def _could_be_missing(value: object) -> bool:
    """Whether ``OmegaConf.is_missing`` must be asked (it is slow: a launch's check of a whole config asks it of a few
    hundred leaves): a node, or a leaf that reads as ``???`` unresolved."""
    return isinstance(value, DictConfig) or (isinstance(value, str) and value == "???")


def group_problems(cfg: DictConfig, data: RunData, model: Optional[LlamaConfig]) -> list[str]:
    """The rules of every group but ``model`` (:func:`model_problems`), for a config whose keys are all known and
    set (:func:`key_problems`); ``lightning_mgpu.cli.spec.resolve_run`` asks them all."""
    return (data_problems(cfg, data, model) + trainer_problems(cfg) + logger_problems(cfg) + optim_problems(cfg)
            + parallel_problems(cfg, model) + checkpoint_problems(cfg) + profile_problems(cfg)
            + bad_steps_problems(cfg) + adapter_problems(cfg, model))


def adapter_problems(cfg: DictConfig, model: Optional[LlamaConfig] = None) -> list[str]:
    """``adapters.*``: the settings, then whether PEFT finds the targets in the model's structure (``model``: the
    package's own model's config, None with model=hf or when the model itself is wrong)."""
    settings = OmegaConf.to_container(cfg.adapters, resolve=True)
    if settings["kind"] == "none":
        return []
    from lightning_mgpu.hf import lora

    problems = lora.settings_problems(settings)
    if problems:
        return problems
    return model_source(cfg).adapter_target_problems(settings, model)


def plan_problems(cfg: DictConfig) -> tuple[Optional[LlamaConfig], list[str]]:
    """(the model to plan for, every problem of a composed ``mgpu-plan`` config: the model, the cluster size, the
    batch and ``plan.*``)."""
    keys = key_problems(cfg)
    if keys:
        return None, keys
    data = resolve_data(cfg) if cfg.data.get("document_mask") else unread_data(cfg)  # the eod id is all it needs
    model, out = model_problems(cfg, data)
    t, d, plan = cfg.trainer, cfg.data, cfg.plan
    out += seq_len_problems(cfg, model) if model is not None else []
    out += _positive("trainer.devices", t.devices) + _positive("trainer.num_nodes", t.num_nodes)
    out += _positive("data.seq_len", d.seq_len) + _positive("data.global_batch_size", d.global_batch_size)
    if plan.gpu not in GPUS:
        out.append(f"plan.gpu={plan.gpu!r} is unknown; choose one of {', '.join(GPUS)}"
                   + did_you_mean(str(plan.gpu), GPUS))
    if plan.achievable is not None and not 0.0 < plan.achievable <= 1.0:
        out.append(f"plan.achievable={plan.achievable} must be a fraction of the peak in (0, 1], e.g. 0.5")
    out += _positive("plan.top", plan.top) + _positive("plan.commands", plan.commands, allow_zero=True)
    return model, out + run_plan_problems(cfg)


#: The whole run's numbers: the key under ``plan``, the lowest value, whether the lowest is allowed, what the
#: setting is and the fix.
_RUN_NUMBERS = (
    ("tokens", 0.0, False, "the run's token budget", "e.g. plan.tokens=2e12, or null for no whole-run plan"),
    ("deadline_hours", 0.0, False, "hours the run must finish in", "e.g. plan.deadline_hours=720 (30 days), or null"),
    ("price_per_gpu_hour", 0.0, True, "the price of one GPU-hour", "e.g. plan.price_per_gpu_hour=2.5"),
    ("gpu_power_w", 0.0, False, "watts one GPU draws", "e.g. plan.gpu_power_w=700, or null for the board power"),
    ("node_overhead_w", 0.0, True, "watts a node draws besides its GPUs", "e.g. plan.node_overhead_w=2000"),
    ("snapshot_gbs_per_gpu", 0.0, False, "GB/s a GPU copies its share of a background checkpoint at",
     "e.g. plan.snapshot_gbs_per_gpu=10"),
    ("pue", 1.0, True, "facility energy over the machines' energy", "e.g. plan.pue=1.2, or 1.0 for the machines"),
)

#: What ``plan.scaling_curve`` can be written as (matplotlib's formats by file name).
CURVE_SUFFIXES = (".png", ".svg", ".pdf")


def run_plan_problems(cfg: DictConfig) -> list[str]:
    """The whole run's settings (``plan.tokens``, the deadline, prices and powers, the scaling curve), before any
    layout is searched: a curve that could not be written is refused here, not after the search."""
    plan, out = cfg.plan, []
    for key, low, inclusive, what, fix in _RUN_NUMBERS:
        value = plan[key]
        if value is not None and not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            out.append(f"plan.{key}={value:g} must be a finite number {'>=' if inclusive else '>'} {low:g} ({what}); "
                       f"set {fix}")
    if plan.deadline_hours is not None and plan.tokens is None:
        out.append(f"plan.deadline_hours={plan.deadline_hours:g} needs the token budget it is a deadline for; set "
                   "plan.tokens, e.g. plan.tokens=2e12")
    if plan.max_nodes is not None:
        out += _positive("plan.max_nodes", plan.max_nodes)
    if plan.scaling_curve is not None:
        out += curve_problems(str(plan.scaling_curve))
    asked = [k for k in ("tokens", "deadline_hours", "scaling_curve") if plan[k] is not None]
    if asked and steps_apart(cfg.parallel.replica_update):
        out.append(f"parallel.replica_update={cfg.parallel.replica_update!r} plans one replica's layout, while "
                   f"{', '.join('plan.' + k for k in asked)} plan{'s' if len(asked) == 1 else ''} one job that steps "
                   "together; plan the whole run with parallel.replica_update=sync parallel.replicas=1, or leave "
                   f"{' and '.join('plan.' + k for k in asked)} null")
    return out


def curve_problems(path: str) -> list[str]:
    """``plan.scaling_curve``: a picture file matplotlib writes, in a folder that exists, with matplotlib there."""
    out, target = [], Path(path)
    if target.suffix.lower() not in CURVE_SUFFIXES:
        out.append(f"plan.scaling_curve={path!r} must name a picture file ending in {', '.join(CURVE_SUFFIXES)}; "
                   "e.g. plan.scaling_curve=scaling.png")
    if not target.parent.is_dir():
        out.append(f"plan.scaling_curve={path!r} is in a folder that does not exist ({target.parent}); create it or "
                   "give a path in an existing folder")
    if importlib.util.find_spec("matplotlib") is None:
        out.append(f"plan.scaling_curve={path!r} needs matplotlib, which is not installed; pip install "
                   "'lightning_mgpu[plot]', or set plan.scaling_curve=null")
    return out
