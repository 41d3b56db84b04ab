"""Everything wrong with a launch, found before any process or process group exists: :func:`check_run` resolves the
run once (``lightning_mgpu.cli.spec``), which asks the config's own rules (``lightning_mgpu.cli.rules``), what this machine lacks (``lightning_mgpu.cli.machine``) and the
memory check (``lightning_mgpu.cli.memory_check``), and raises one :class:`~lightning_mgpu.cli.errors.ConfigError`
with every problem; ``lightning_mgpu.cli.errors`` turns it into exit status 2.
"""

from __future__ import annotations

from omegaconf import DictConfig

from lightning_mgpu.cli.dry_run import fp8_kernel_problems
from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.machine import launch_problems, machine_problems
from lightning_mgpu.cli.memory_check import memory_problems
from lightning_mgpu.cli.rules import key_problems
from lightning_mgpu.cli.spec import RunSpec, resolve_run


def check_run(cfg: DictConfig) -> RunSpec:
    """The run of ``cfg``, resolved once; raises :class:`ConfigError` listing every reason it cannot run here,
    before anything starts.

    Memory is estimated only for a configuration without other problems (it needs a valid layout and a machine
    that can run it).
    """
    spec, problems = resolve_run(cfg)
    if spec is not None:
        problems += fp8_kernel_problems(spec)
    if not (key_problems(cfg) or launch_problems(cfg)):  # else the sizes cannot be read
        problems += machine_problems(cfg)
    if not problems:
        problems = memory_problems(spec)
    if problems:
        raise ConfigError(problems)
    return spec
