"""A composed ``mgpu-train`` config resolved once into one frozen :class:`RunSpec`: the model config, the data with its
tokenizer, manifests and end-of-document id (:class:`~lightning_mgpu.cli.run_data.RunData`), the layout request and
the checkpoint settings. The rules ask its parts (``lightning_mgpu.cli.rules``), the builders instantiate from it
(``lightning_mgpu.cli.build``), the dry run splits it, and the memory check's fixes are replacements of it
(:meth:`RunSpec.replaced`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.checkpoint.formats import CheckpointSettings
from lightning_mgpu.cli.layout_rules import parallel_problems
from lightning_mgpu.cli.machine import launch_problems
from lightning_mgpu.cli.rules import group_problems, key_problems, model_problems
from lightning_mgpu.cli.run_data import RunData, resolve_data
from lightning_mgpu.layout import LayoutRequest
from lightning_mgpu.models import LlamaConfig

@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: built once per process and read by everything after validation."""

    config: DictConfig  #: the composed config, read-only (what ``config.yaml`` records)
    model: LlamaConfig
    data: RunData
    layout: LayoutRequest
    checkpoint: CheckpointSettings

    @property
    def world_size(self) -> int:
        return self.config.trainer.devices * self.config.trainer.num_nodes

    @classmethod
    def of(cls, cfg: DictConfig, data: RunData, model: LlamaConfig) -> "RunSpec":
        config = copy.deepcopy(cfg)
        OmegaConf.set_readonly(config, True)
        names = LayoutRequest.__dataclass_fields__
        layout = LayoutRequest(**{name: cfg.parallel[name] for name in names})
        checkpoint = CheckpointSettings(cfg.checkpoint.format, cfg.checkpoint.trust_deepspeed_checkpoints)
        return cls(config, model, data, layout, checkpoint)

    def replaced(self, overrides: dict) -> Optional["RunSpec"]:
        """This run with ``overrides`` (``{config key: value}``) applied and its data kept as resolved; None when the
        change breaks a rule of the model or the layout."""
        changed = copy.deepcopy(self.config)
        OmegaConf.set_readonly(changed, False)
        for key, value in overrides.items():
            OmegaConf.update(changed, key, value, merge=False)
        model, problems = model_problems(changed, self.data)
        if problems or model is None or parallel_problems(changed, model):
            return None
        return RunSpec.of(changed, self.data, model)


def resolve_run(cfg: DictConfig, launching: bool = True, build: bool = True) -> tuple[Optional[RunSpec], list[str]]:
    """(the run of ``cfg``, or None; every problem of the config itself: empty when it can run on suitable machines).

    What this machine lacks to run it is ``machine_problems``; ``check_run`` asks both. With ``launching=False``
    (the dry run, which starts nothing) how the job would be launched is not checked; with ``build=False`` only the
    problems are wanted, and no run is built (it copies the whole config).
    """
    keys = key_problems(cfg)
    if keys:  # reading a ??? value raises, and an unknown key means the rest was not what the user meant
        return None, keys
    launch = launch_problems(cfg) if launching else []
    if launch:  # sizes of torchrun/SLURM jobs come from the launcher's environment; nothing else can be checked
        return None, launch
    data = resolve_data(cfg)
    model, problems = model_problems(cfg, data)
    problems += group_problems(cfg, data, model)
    if problems or model is None or not build:
        return None, problems
    return RunSpec.of(cfg, data, model), []


def config_problems(cfg: DictConfig, launching: bool = True) -> list[str]:
    """Every problem of a composed ``mgpu-train`` config itself (see :func:`resolve_run`)."""
    return resolve_run(cfg, launching, build=False)[1]


def run_spec(cfg: DictConfig, launching: bool = True) -> RunSpec:
    """The run of a config known to be valid; raises ``ConfigError`` with every problem otherwise."""
    spec, problems = resolve_run(cfg, launching)
    if spec is None:
        from lightning_mgpu.cli.errors import ConfigError

        raise ConfigError(problems)
    return spec
