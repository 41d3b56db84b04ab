"""The sbatch script that ``cluster=slurm`` would submit, without submitting it (to check a setup before queueing).

Maps the composed ``hydra.launcher`` node (hydra-submitit-launcher's ``submitit_slurm``) to sbatch options
with submitit's own name table, then asks submitit for the file text. submitit's executor refuses to start
where ``srun`` is missing, so its module-level script builder is called directly.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

_NOT_SBATCH = ("submitit_folder", "max_num_timeout", "_target_", "stderr_to_stdout")


def sbatch_script(launcher: DictConfig, folder: str, command: str = "python -u -m submitit.core._submit") -> str:
    """The text of the sbatch file for ``launcher`` (a resolved ``hydra.launcher`` node)."""
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem, _make_sbatch_string

    names = SlurmExecutor._equivalence_dict()
    params: dict[str, Any] = {}
    for key, value in OmegaConf.to_container(launcher, resolve=True).items():
        if key in _NOT_SBATCH or value is None:
            continue
        params[names.get(key, key)] = value
    if "mem" in params:
        params["mem"] = _convert_mem(params["mem"])
    return _make_sbatch_string(command=command, folder=folder, **params)
