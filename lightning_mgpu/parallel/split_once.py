"""The LightningModule split for this rank once per fit: a Trainer runs the strategy's ``setup`` again for a later
``validate``/``test``/``predict`` on the same module, which must not be split a second time."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.parallelize import parallelize
from lightning_mgpu.parallel.plan import TensorParallelPlan

#: For ZeRO-3: given the kept module, the function that partitions each module's parameters as they are filled.
Partitioner = Callable[[torch.nn.Module], Callable[[list[torch.nn.Parameter]], None]]


class SplitOnce:
    """Remembers which module it split, the stage container (pipeline parallelism only), the tensor-parallel plan's
    notes and the parameter elements this rank gave storage to after building on the meta device (0: built for
    real)."""

    def __init__(self) -> None:
        self.module: Optional[torch.nn.Module] = None
        self.stage_container: Optional[torch.nn.Module] = None
        self.notes: list[str] = []
        self.materialized = 0

    def __call__(self, module: torch.nn.Module, layout: ParallelLayout, device: torch.device,
                 plan: Optional[TensorParallelPlan], boundaries: Optional[list[int]],
                 partitioner: Optional[Partitioner]) -> Optional[torch.nn.Module]:
        """The stage container with pipeline stages (None without), splitting ``module`` if it is a new one."""
        if self.module is not module:
            done = parallelize(module, layout, device, plan, boundaries, partitioner)
            self.notes, self.materialized = done.notes, done.materialized
            for note in done.notes:
                rank_zero_info(note)
            self.stage_container = done.module if layout.size("pp") > 1 else None
            self.module = module
        return self.stage_container
