"""The training engine: everything that knows DeepSpeed lives in this package, and nothing outside it imports
DeepSpeed (a test checks). The rest of the project builds an engine over its parallelised module, steps it,
defers its gradient reduction, gathers ZeRO-3 partitions and reads or writes per-parameter optimizer state
through the names below; another engine would provide the same names.

* ``config``: the DeepSpeed config generated from the layout, the model and the precision;
* ``runtime``: comm setup, engine construction over the layout's groups, the engine calls used elsewhere;
* ``parameter_state``: one parameter's fp32 value and Adam moments, for layout-independent checkpoints;
* ``checkpoint_dir``: DeepSpeed's own checkpoint directories;
* ``master_weights``: this rank's share of the fp32 master weights, for the replicas' outer step.
"""

import os

import torch

# DeepSpeed guesses its accelerator at import and, finding no GPU, warns "Setting accelerator to CPU. If you have GPU
# or other accelerator, we were unable to detect it." on every CPU run. The same test it makes (no CUDA device), made
# here first, names the CPU instead; a DS_ACCELERATOR the user set is kept.
if "DS_ACCELERATOR" not in os.environ and torch.cuda.device_count() == 0:
    os.environ["DS_ACCELERATOR"] = "cpu"

from lightning_mgpu.engine.checkpoint_dir import load_engine_checkpoint, save_engine_checkpoint
from lightning_mgpu.engine.config import (
    bucket_elements,
    bucket_elements_for,
    deep_merge,
    drifts_from_fp32,
    evaluation_config,
    parameter_dtype,
    parameter_elements,
    parameter_shape,
    precision_config,
    run_config,
    zero_config,
)
from lightning_mgpu.engine.master_weights import master_weights, refresh_working_weights
from lightning_mgpu.engine.parameter_state import MOMENTS, ParameterState, moments_of
from lightning_mgpu.engine.runtime import (
    EngineOwnedOptimizer,
    LayoutMPU,
    accumulation_steps,
    backward,
    data_parallel_size,
    deferred_grad_reduction,
    gathered,
    init_engine_comm,
    initialize_engine,
    loss_scale,
    preload,
    step,
    zero3_partitioner,
    zero_stage,
)

__all__ = [
    "EngineOwnedOptimizer", "LayoutMPU", "MOMENTS", "ParameterState", "moments_of", "accumulation_steps", "backward", "bucket_elements",
    "bucket_elements_for", "data_parallel_size", "deep_merge", "deferred_grad_reduction", "drifts_from_fp32",
    "evaluation_config", "gathered", "init_engine_comm", "initialize_engine", "load_engine_checkpoint", "loss_scale",
    "master_weights", "parameter_dtype", "parameter_elements", "parameter_shape", "precision_config", "preload",
    "refresh_working_weights", "run_config", "save_engine_checkpoint", "step",
    "zero3_partitioner", "zero_config", "zero_stage",
]
