"""This rank's share of the engine's fp32 master weights, as tensors that can be changed in place, and the refresh
of the working weights the forward uses from them: what an outer step over replicas acts on
(``lightning_mgpu.parallel.replicas``). torch's model averagers act on module parameters, which the next ZeRO step
would overwrite from the masters; so this reads DeepSpeed's master partitions, which it does not expose for writing
through a public call (``safe_set_full_fp32_param`` sets one whole parameter, gathered, at a time).

The shares are the same on every replica (the same layout inside each), so they reduce elementwise across replicas.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mgpu.engine.runtime import zero_stage
from lightning_mgpu.precision import replica_precision_problems
from lightning_mgpu.problems import raise_problems


def master_weights(engine: Any) -> list[torch.Tensor]:
    """The fp32 master tensors this rank updates: ZeRO-0 the module's parameters (fp32 only), ZeRO 1-2 the flat fp32
    partitions, ZeRO-3 the flat fp32 partitions of the sub-groups."""
    stage, optimizer = zero_stage(engine), engine.optimizer
    if stage == 0:  # the rule is the strategy's (checked at setup); here it guards direct callers
        precision = "bf16-mixed" if engine.bfloat16_enabled() else "16-mixed" if engine.fp16_enabled() else "32-true"
        raise_problems("Invalid parallel layout", replica_precision_problems(precision, 0, "local"))
        return [p for p in engine.module.parameters() if p.requires_grad]
    if stage in (1, 2):
        return list(optimizer.single_partition_of_fp32_groups)
    return list(optimizer.fp32_partitioned_groups_flat)


def refresh_working_weights(engine: Any) -> None:
    """Copy the masters into the weights the forward runs on (and, ZeRO 1-2, all-gather them over the data-parallel
    group), as the engine does after its own optimizer step."""
    stage, optimizer = zero_stage(engine), engine.optimizer
    if stage in (1, 2):
        optimizer.update_lp_params()
    elif stage == 3:  # what the ZeRO-3 step does around updating its masters (stage3.py: step, _post_step)
        optimizer._partition_all_parameters()  # the small parameters it keeps whole are released, to be gathered
        for sub_group in range(len(optimizer.fp32_partitioned_groups_flat)):
            optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
        if optimizer.persistent_parameters:  # small parameters stay gathered whole: gather them again
            optimizer.persistent_parameters[0].all_gather(optimizer.persistent_parameters)
        optimizer.invalidate_secondary_tensor()
