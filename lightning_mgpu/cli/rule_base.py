"""What the config rules share: the accepted names of a few settings, the positive-number rule, and the one table
from a rule's setting name to the config key it is set by (:data:`CONFIG_KEYS`, used by :func:`keyed`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from omegaconf import DictConfig

from lightning_mgpu.data.manifest import TOKEN_DTYPES as _NUMPY_TOKEN_DTYPES
from lightning_mgpu.problems import Problem


ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


LAUNCHERS = ("local", "torchrun", "slurm")


DATA_SOURCES = ("corpus", "text", "tokens", "sft")


TOKEN_DTYPES = tuple(_NUMPY_TOKEN_DTYPES)


#: trainer.max_time as Lightning's Timer parses it: days:hours:minutes:seconds.
_MAX_TIME = re.compile(r"^\d+:\d+:\d+:\d+$")


#: The one table from a rule's setting name to the ``mgpu-train`` config key it is set by.
CONFIG_KEYS = {
    **{name: f"parallel.{name}" for name in (
        "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "zero_stage", "pipeline_schedule",
        "virtual_pipeline_size", "num_microbatches", "sequence_parallel", "offload_optimizer", "offload_params",
        "pipeline_boundaries", "replicas", "replica_update", "sync_every", "outer_optimizer", "max_staleness",
        "slow_ranks", "expert_parallel_size")},
    "tie_embeddings": "model.tie_embeddings", "precision": "trainer.precision", "fp8": "trainer.fp8",
    "accumulate_grad_batches": "trainer.accumulate_grad_batches", "seq_len": "data.seq_len",
    "document_mask": "data.document_mask",
}


def keyed(problems: Sequence, t: DictConfig) -> list[str]:
    """Problems of the layout (and the rules beside it) as the lines the command line prints, named by their config
    keys (:data:`CONFIG_KEYS`)."""
    out = []
    for problem in problems:
        if isinstance(problem, Problem):
            problem = problem.keyed(CONFIG_KEYS)
            if problem.field == "world_size":
                problem = dataclasses.replace(
                    problem, field=f"trainer.devices x trainer.num_nodes = {t.devices} x {t.num_nodes}: world_size")
        out.append(str(problem))
    return out


def _positive(key: str, value, allow_zero: bool = False) -> list[str]:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [f"{key}={value!r} must be an integer >= {low}"]
    return []
