"""The whole model's weights from any layout, on global rank 0: tensor shards concatenated (padding dropped),
experts split by expert parallelism joined, pipeline stages merged, ZeRO-3 partitions gathered.

Each rank holds plain local shards tagged by the tensor-parallel layers (``partition_dim``, ``full_size``), so
reassembly needs no knowledge of the model. Names are the model's own (``layers.3.attention.wq.weight``):
the LightningModule's attribute prefix (``model.``) or a pipeline container's stage key is dropped. Rank 0
holds the whole model in CPU memory: meant for export and small-to-medium models.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_mgpu.engine import gathered
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.frozen import is_placeholder


def _canonical(name: str, pipelined: bool, prefix: str) -> str:
    if pipelined:
        return name.split(".", 1)[1]  # "<stage id>.layers.5...." -> "layers.5...."
    return name[len(prefix):] if name.startswith(prefix) else name


def _gather_tensor_parallel(t: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or layout.size("tp") == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(layout.size("tp"))]
    dist.all_gather(parts, t.contiguous(), group=layout.group("tp"))
    return torch.cat(parts, dim=param.partition_dim).narrow(param.partition_dim, 0, param.full_size)


def _gather_experts(t: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout) -> torch.Tensor:
    """An expert-parallel rank's experts (``expert_partition``: the ``ep_rank``-th run of ``E / Ep`` along the first
    dimension) joined with the other ranks' of its expert group, in group rank order."""
    if getattr(param, "expert_partition", None) is None or layout.size("ep") == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(layout.size("ep"))]
    dist.all_gather(parts, t.contiguous(), group=layout.group("ep"))
    return torch.cat(parts, dim=0)


def consolidated_state_dict(engine, layout: ParallelLayout, prefix: str = "model.") -> Optional[dict[str, torch.Tensor]]:
    """fp32 copies of every weight of the model, on global rank 0 (``None`` elsewhere). Collective."""
    pipelined = layout.size("pp") > 1
    mine: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        if (not pipelined and not name.startswith(prefix)) or is_placeholder(name):
            continue
        with gathered([param]):
            local = param.detach().float().clone()
        mine[_canonical(name, pipelined, prefix)] = _gather_experts(_gather_tensor_parallel(local, param, layout),
                                                                    param, layout)
    if not pipelined:
        return mine if dist.get_rank() == 0 else None
    stages: list = [None] * layout.size("pp")
    dist.all_gather_object(stages, mine if layout.rank("tp") == 0 else None, group=layout.group("pp"))
    if dist.get_rank() != 0:
        return None
    return {k: v for part in stages for k, v in part.items()}
