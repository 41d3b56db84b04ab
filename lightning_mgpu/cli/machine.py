"""What this machine lacks to run a config here: visible CUDA GPUs, a logger's package, a ``model=hf`` directory's
weights, the launcher it was started by. Asked at launch after the config's own rules (``lightning_mgpu.cli.rules``), never by the dry run."""

from __future__ import annotations

import importlib.util
import os

from omegaconf import DictConfig

from lightning_mgpu.cli.model_source import model_source


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
    return out + model_source(cfg).machine_problems() + gpu_problems(cfg.trainer.accelerator, cfg.trainer.devices)


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
