"""``mgpu-train``: the Hydra app. ``train(cfg)`` is a plain function (tests call it); ``main`` is the entry point."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.callbacks import PeriodicCheckpoint, ThroughputCallback, newest_checkpoint
from lightning_mgpu.resilience.preemption import REQUEUE_EXIT, Preemption, slurm_requeue_command
from lightning_mgpu.resilience.fingerprint import SilentCorruptionCheck
from lightning_mgpu.resilience.rollback import RollbackOnSkips, read_skip_file
from lightning_mgpu.callbacks.comm import CommunicationCounter
from lightning_mgpu.callbacks.profile import ProfileSteps
from lightning_mgpu.checkpoint.formats import replica_checkpoint_problems
from lightning_mgpu.cli.build import build_datamodule, build_loggers, build_module, build_strategy, build_tokenizer
from lightning_mgpu.cli.config import TrainConfig, register_configs
from lightning_mgpu.cli.paths import conf_dir
from lightning_mgpu.cli.dry_run import dry_run_report
from lightning_mgpu.cli.errors import exit_on_refusal, refusal_exits, run_rank
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.cli.metrics_history import KeepMetricsBeforeResume
from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.cli.quiet import quiet_known_warnings
from lightning_mgpu.cli.memory_check import memory_problems
from lightning_mgpu.resilience.elastic import run_local_job
from lightning_mgpu.resilience.restarts import EXIT_FAULTY_DEVICE, RestartRecord, attempt, record_faulty_device
from lightning_mgpu.cli.spec import RunSpec, run_spec
from lightning_mgpu.cli.validate import check_run
from lightning_mgpu.data import decode_bytes, encode_bytes
from lightning_mgpu.data.sft import held_out_prompt
from lightning_mgpu.resilience.faults import fault_callbacks
from lightning_mgpu.layout import theoretical_bubble
from lightning_mgpu.parallel.timeline import bubble_fraction, gather_step, plot_timeline, save_actions
from lightning_mgpu.problems import format_problems

#: The resolved config of a run, in its run directory; local workers load it.
CONFIG_NAME = "config.yaml"
#: The arguments of an elastic rank that is not forked, before its run directory (``-P``: the installed package, not a
#: folder of the working directory).
WORKER_COMMAND = ("-P", "-m", "lightning_mgpu.cli.worker")
#: Set by Lightning's launcher in the launching process; with LOCAL_RANK left set, a next job would take its
#: processes for externally launched ones.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def train(cfg: DictConfig, run_dir: Path, worker: bool = False, spec: Optional[RunSpec] = None) -> dict:
    """Train as ``cfg`` says, writing ``config.yaml`` and ``metrics.csv`` into ``run_dir``; return final metrics.

    Every problem with ``cfg`` (and what this machine lacks to run it) is raised at once as a
    :class:`~lightning_mgpu.cli.errors.ConfigError` before anything starts. The resolved config is written
    once, by the process that starts first; with ``cluster=local`` the other local ranks are started as
    workers that load it (``worker=True``), so every rank trains from the same config in the same directory.
    ``spec``: ``cfg`` already checked (by the elastic agent that forks this rank).
    """
    if cfg.dry_run:  # no GPU, no process group, no memory for weights: the config's own problems only
        spec = run_spec(cfg, launching=False)
        print(dry_run_report(spec))
        memory = memory_problems(spec)  # this machine's verdict, as a launch here would give it
        print(format_problems("a launch here would be refused", memory) if memory else
              "memory: fits on this machine (cluster.check_memory)")
        return {}
    spec = spec or check_run(cfg)
    if not worker and _launch_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / CONFIG_NAME, resolve=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    strategy = build_strategy(spec)
    if cfg.cluster.launcher == "local" and not worker:
        strategy.worker_command = [sys.executable, "-m", "lightning_mgpu.cli.worker", str(run_dir.resolve())]
        if cfg.cluster.fork_on_cpu:
            strategy.fork_entry = functools.partial(train_worker, str(run_dir.resolve()))
    datamodule, module = build_datamodule(spec), build_module(spec)
    # the batches a rollback left out (bad_steps.rollback_after), with data.skip_batches
    datamodule.skip_batches |= frozenset(read_skip_file(checkpoint_dir(cfg, run_dir)))
    launch_env = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    trainer = L.Trainer(strategy=strategy, callbacks=_callbacks(cfg, run_dir), **trainer_arguments(cfg, run_dir))
    try:
        return _fit(spec, run_dir, trainer, strategy, module, datamodule)
    finally:  # leave the process as it was, so that the next job of a multirun sweep starts its own ranks
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name, value in launch_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def train_worker(run_dir: str, cfg: Optional[DictConfig] = None, spec: Optional[RunSpec] = None) -> dict:
    """A rank the first process started (a local rank > 0, or any rank under the elastic agent): train from the
    resolved ``config.yaml`` the first process wrote into ``run_dir`` (``cfg``: that config, read once by a parent that
    forks the ranks: 0.8 s of a restart less; ``spec``: that config checked, by the same parent)."""
    skip_final_garbage_collection()
    return train(cfg or run_config(run_dir), Path(run_dir), worker=True, spec=spec)


def run_config(run_dir: str | Path) -> DictConfig:
    """The resolved ``config.yaml`` of ``run_dir``, as the schema types it."""
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(Path(run_dir) / CONFIG_NAME))


def trainer_arguments(cfg: DictConfig, run_dir: Path) -> dict:
    """The ``lightning.Trainer`` arguments of ``cfg.trainer`` and ``cfg.logger`` (all but strategy and callbacks)."""
    t = cfg.trainer
    val_check_interval = t.val_check_interval
    if val_check_interval is None and t.check_val_every_n_epoch is None:  # once, after the last optimizer step
        val_check_interval = t.max_steps * t.accumulate_grad_batches
    # A float in the schema (OmegaConf types no int | float): 1.0 is all (None, Lightning's default), above 1 a count.
    limit_val = t.limit_val_batches
    limit_val = None if limit_val == 1.0 else int(limit_val) if limit_val > 1 else limit_val
    return dict(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
        max_steps=t.max_steps, max_time=t.max_time, max_epochs=t.max_epochs,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        # The training stream is endless (one batch per step), so validation is scheduled in batches, counted over
        # the whole run, unless epochs are asked for (limit_train_batches + check_val_every_n_epoch).
        val_check_interval=val_check_interval, check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_train_batches=t.limit_train_batches, limit_val_batches=limit_val,
        # (a restarted attempt skips them: RestartRecord)
        num_sanity_val_steps=t.num_sanity_val_steps, log_every_n_steps=t.log_every_n_steps,
        deterministic=t.deterministic, benchmark=t.benchmark, detect_anomaly=t.detect_anomaly,
        enable_progress_bar=t.enable_progress_bar, enable_model_summary=t.enable_model_summary,
        enable_checkpointing=False, use_distributed_sampler=False,
        logger=build_loggers(cfg, run_dir) or False, default_root_dir=str(run_dir),
    )


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def profile_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.profile.dir) if cfg.profile.dir else run_dir / "profile"


def resume_path(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """``checkpoint.resume``: ``auto`` -> the checkpoint directory when it holds a complete checkpoint (the strategy
    loads the newest one this run may read and that is intact, and says which it skipped), else a fresh start, so a
    requeued job continues by itself; a path -> that checkpoint."""
    resume = cfg.checkpoint.resume
    if resume == "auto":
        directory = checkpoint_dir(cfg, run_dir)
        return str(directory) if newest_checkpoint(directory) is not None else None
    return resume


def _callbacks(cfg: DictConfig, run_dir: Path) -> list[L.Callback]:
    out: list[L.Callback] = [SameConfigOnEveryRank(cfg)]
    if cfg.throughput.enabled:
        out.append(ThroughputCallback(cfg.throughput.peak_flops))
    out.append(RestartRecord(run_dir))  # the last step finished, for what a restart loses: before its save
    out.append(KeepMetricsBeforeResume())  # metrics.csv keeps the steps before a resumed checkpoint
    saver = PeriodicCheckpoint(checkpoint_dir(cfg, run_dir), cfg.checkpoint.every_n_steps or 1, cfg.checkpoint.keep_last,
                               cfg.checkpoint.async_save)
    if cfg.checkpoint.every_n_steps:
        out.append(saver)
    # a signal to any rank: every rank stops after the step, with an emergency checkpoint (none where the run cannot
    # write one), then exits with REQUEUE_EXIT
    can_save = not replica_checkpoint_problems(cfg.parallel.replica_update, cfg.checkpoint.format)
    requeue = slurm_requeue_command(dict(os.environ)) if cfg.cluster.launcher == "slurm" else None
    out.append(Preemption(saver if can_save else None, requeue=requeue))
    if cfg.sdc.every_n_steps:  # after the saver: a corruption found sets aside the checkpoints it published since
        out.append(SilentCorruptionCheck(cfg.sdc.every_n_steps, checkpoint_dir(cfg, run_dir)))
    if cfg.bad_steps.rollback_after:  # after the saver, likewise
        out.append(RollbackOnSkips(cfg.bad_steps.rollback_after, cfg.bad_steps.rollback_window,
                                   checkpoint_dir(cfg, run_dir)))

    if cfg.throughput.count_communication:  # off by default: a Python call per operator while a step runs
        out.append(CommunicationCounter())
    if cfg.profile.steps:  # none without chosen steps: an unprofiled run has no profiler and no check per batch
        p = cfg.profile
        out.append(ProfileSteps(p.steps, profile_dir(cfg, run_dir), record_shapes=p.record_shapes,
                                with_stack=p.with_stack, largest_tensors=p.largest_tensors))
    out.extend(fault_callbacks(attempt=attempt()))  # fault injection (MGPU_*_AT variables); none without them
    return out


def _launch_rank() -> int:
    """This process's global rank as its launcher set it (0 for the process that starts a local job)."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class SameConfigOnEveryRank(L.Callback):
    """Refuse to train when ranks resolved different configs (e.g. torchrun nodes given different overrides)."""

    def __init__(self, cfg: DictConfig) -> None:
        # JSON of the resolved values, not YAML: the same digest of the same config, 10x less CPU (40 ms a rank here)
        flat = json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)
        self.digest = hashlib.sha256(flat.encode()).hexdigest()[:12]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not torch.distributed.is_initialized():
            return
        digests: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, self.digest)
        if len(set(digests)) > 1:
            ranks = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
            raise RuntimeError(f"ranks resolved different configs ({ranks}): start every rank with the same recipe and "
                               "overrides (with cluster=torchrun, the same --rdzv-id on every node)")


def _fit(spec: RunSpec, run_dir: Path, trainer: L.Trainer, strategy, module, datamodule) -> dict:
    """Fit, then optionally save, report the pipeline timeline and print a sample."""
    cfg = spec.config
    trainer.fit(module, datamodule, ckpt_path=resume_path(cfg, run_dir))
    preempted = next((c.preempted for c in trainer.callbacks if isinstance(c, Preemption)), None)
    stopped_to_go_back = [c for c in trainer.callbacks if isinstance(c, SilentCorruptionCheck) and c.corruption
                          or isinstance(c, RollbackOnSkips) and c.rollback]
    checks = [c for c in trainer.callbacks if isinstance(c, SilentCorruptionCheck)]
    persistent = [c.corruption for c in checks if c.corruption and c.corruption.persistent]
    if persistent:  # found again on the rerun: named for the agent's record, not restarted on these machines
        record_faulty_device(run_dir, persistent[0].record(), trainer.global_rank)
        raise SystemExit(EXIT_FAULTY_DEVICE)
    if preempted is not None or stopped_to_go_back:  # resume with checkpoint.resume=auto (the launcher or scheduler
        raise SystemExit(REQUEUE_EXIT)  # starts it again): after a corruption or a rollback, from before it
    if cfg.checkpoint.save_last:
        PeriodicCheckpoint(checkpoint_dir(cfg, run_dir), 1, cfg.checkpoint.keep_last).save(trainer,
                                                                                          trainer.global_step)
    if cfg.parallel.pipeline_timeline and strategy.pipeline is not None:
        report_timeline(strategy, trainer.global_step - 1, run_dir)
    reason = no_sample_reason(spec)
    if reason is not None:
        if trainer.is_global_zero:
            print(f"(no sample: {reason})")
    else:
        sample = generate_sample(module, spec)
        if trainer.is_global_zero:
            print(f"\n--- sample after {trainer.global_step} steps ---\n{sample}\n---")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def report_timeline(strategy, step: int, run_dir: Path) -> None:
    """Write the last step's pipeline Gantt chart to ``timeline.png`` (its actions to ``timeline.json``) and print its
    bubble beside the theory."""
    layout = strategy.layout
    per_rank = gather_step(strategy.pipeline.timeline, layout, step)
    if per_rank is None:
        return
    measured = bubble_fraction(per_rank)
    theory = theoretical_bubble(layout.pipeline_schedule, layout.pipeline_parallel_size, strategy.num_microbatches,
                                layout.virtual_pipeline_size)
    title = (f"{layout.pipeline_schedule}, P={layout.pipeline_parallel_size}, M={strategy.num_microbatches}, "
             f"V={layout.virtual_pipeline_size}: bubble {measured:.1%} measured, {theory:.1%} theoretical")
    path = plot_timeline(per_rank, run_dir / "timeline.png", title)
    save_actions(per_rank, run_dir / "timeline.json", title)
    print(f"pipeline timeline of step {step}: {path} ({title})")


def no_sample_reason(spec: RunSpec) -> Optional[str]:
    """Why the run prints no sample at its end, or None when it does."""
    cfg, lost = spec.config, spec.data.lost_tokenizer
    if cfg.parallel.pipeline_parallel_size > 1 or cfg.parallel.context_parallel_size > 1:
        split = "pipeline stages" if cfg.parallel.pipeline_parallel_size > 1 else "context-parallel sequence chunks"
        return (f"generation needs the whole model and whole sequences on each rank, and this run splits them into "
                f"{split}")
    if lost is not None:
        return (f"the tokens were prepared with the tokenizer {lost}, which is missing or changed; set "
                "data.tokenizer=PATH to decode them")
    return model_source(cfg).no_sample_reason(bool(cfg.parallel.sequence_parallel), spec.data.tokenizer is not None)


def generate_sample(module, spec: RunSpec) -> str:
    """A short continuation of ``sample.prompt`` (with ``data=sft``: of a held-out conversation up to its first answer),
    encoded and decoded with the run's tokenizer (bytes without one).
    Every rank runs it (ZeRO-3 gathers parameters collectively) with the same generator, so all ranks produce the
    same text."""
    cfg, tokenizer = spec.config, build_tokenizer(spec)
    module.eval()
    device = next(module.parameters()).device
    if cfg.data.source == "sft":  # a held-out conversation's turns up to its answer, as its chat template rendered them
        ids = held_out_prompt(cfg.data.path, cfg.data.val_fraction).tolist()
    else:
        ids = encode_bytes(cfg.sample.prompt) if tokenizer is None else tokenizer.encode(cfg.sample.prompt)
    prompt = torch.as_tensor(ids, dtype=torch.int64)[None].to(device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = module.generate(prompt, cfg.sample.max_new_tokens, temperature=cfg.sample.temperature,
                            generator=generator)
    return decode_bytes(tokens[0].tolist()) if tokenizer is None else tokenizer.decode(tokens[0].tolist())


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with refusal_exits():
        if cfg.cluster.max_restarts and not cfg.dry_run:
            code = restart_on_failure(cfg, run_dir)
            if code:  # a sweep (-m) goes on to its next job after a success
                raise SystemExit(code)
            return
        train(cfg, run_dir)


def restart_on_failure(cfg: DictConfig, run_dir: Path) -> int:
    """``cluster.max_restarts``: this process becomes torch's elastic agent for the job's ranks
    (``resilience/elastic.py``), each of which trains from the resolved config written here; the job's exit status."""
    check_run(cfg)  # refused here, once, not by every attempt
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / CONFIG_NAME, resolve=True)
    on_cpu = cfg.trainer.accelerator == "cpu" or (cfg.trainer.accelerator == "auto" and not torch.cuda.is_available())
    fork = cfg.cluster.fork_on_cpu and on_cpu and not torch.cuda.is_initialized()
    worker_cfg, spec = run_config(run_dir), None
    if fork:  # once, in the process every rank of every attempt is forked from: not again after each restart
        from lightning_mgpu import engine

        engine.preload()
        spec = check_run(worker_cfg)
        _first_metric()
    entry = functools.partial(run_rank, functools.partial(train_worker, str(run_dir), worker_cfg, spec))
    worker = None if fork else WORKER_COMMAND + (str(run_dir),)
    return run_local_job(entry, run_dir, cfg.trainer.devices, cfg.cluster.max_restarts,
                         cfg.cluster.crash_loop_attempts, worker)


def _first_metric() -> None:
    """Build a torchmetrics metric, as every rank's module does: the first one reads the installed packages' metadata
    to check torch's version (3 lookups, 0.04 CPU-s a rank under cProfile), and forked ranks inherit the answer."""
    from torchmetrics import MeanMetric

    MeanMetric()


def main() -> None:
    """Console entry point of ``mgpu-train``: a refused configuration prints its problems and exits with status 2."""
    skip_final_garbage_collection()
    quiet_known_warnings()
    register_configs()
    exit_on_refusal(_hydra_main)


if __name__ == "__main__":
    main()
