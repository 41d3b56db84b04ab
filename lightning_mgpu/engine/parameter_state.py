"""One parameter's fp32 value and Adam moments out of (and back into) the engine, whatever its ZeRO stage.

Layout-independent checkpoints read and write through this: DeepSpeed keeps the fp32 master weights and the
optimizer state in flat partitions (ZeRO 1-3) or next to the parameter (ZeRO-0), and its ``safe_get_full_*`` /
``safe_set_full_*`` helpers address them per parameter.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_mgpu.engine.runtime import gathered, zero_stage

#: The optimizer state kept per parameter (torch's Adam and AdamW); a parameter Muon steps keeps its own keys
#: (``param.optimizer_state_keys``, see :func:`lightning_mgpu.optim.tag_state_keys`).
MOMENTS = ("exp_avg", "exp_avg_sq")


def moments_of(param: torch.nn.Parameter) -> tuple[str, ...]:
    """The optimizer-state keys kept for ``param``."""
    return getattr(param, "optimizer_state_keys", MOMENTS)


class ParameterState:
    """Read and write one parameter's fp32 value and Adam moments, whatever the ZeRO stage."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = zero_stage(engine)
        self.optimizer = engine.optimizer
        if self.stage == 0 and engine.bfloat16_enabled():
            raise NotImplementedError("layout-independent checkpoints of bf16 ZeRO-0 engines are not supported (its "
                                      "optimizer wrapper exposes no per-parameter state); use zero_stage >= 1, "
                                      "precision='32-true', or checkpoint_format='deepspeed'")
        self.inner = getattr(self.optimizer, "optimizer", self.optimizer)
        #: False for an engine built to evaluate (validate/test/predict): it has no optimizer, and ZeRO-3 keeps only
        #: its parameter partitions (no fp32 master), so a load sets the weights alone.
        self.trains = self.optimizer is not None and hasattr(self.optimizer, "param_groups")
        if self.stage in (1, 2) and self.step():  # point each parameter's fragment at the current Adam state
            self._relink()

    def _relink(self) -> None:
        self.optimizer._hp_optimizer_states_linked = False
        self.optimizer._lazy_init_hp_params_optimizer_state()

    def step(self) -> int:
        """The optimizer's step count (0 before the first step)."""
        for state in getattr(self.inner, "state", {}).values():
            if "step" in state:
                return int(state["step"])
        return 0

    def get(self, param: torch.nn.Parameter, key: Optional[str]) -> torch.Tensor:
        """The fp32 value (``key=None``) or the moment ``key`` of this rank's whole (tensor-parallel) shard."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.stage == 0:
            if key is None:
                return param.detach().float().clone()
            state = self.optimizer.state.get(param, {})
            return state[key].detach().clone() if key in state else torch.zeros_like(param, dtype=torch.float32)
        if key is None:
            return safe_get_full_fp32_param(param).detach().clone().reshape(self.shape(param))
        if self.step() == 0:
            return torch.zeros(self.shape(param))
        return safe_get_full_optimizer_state(param, key).detach().clone().reshape(self.shape(param))

    def shape(self, param: torch.nn.Parameter) -> torch.Size:
        """The shape of the shard this rank holds, before ZeRO-3 partitioning."""
        return param.ds_shape if hasattr(param, "ds_shape") else param.shape

    def like(self, param: torch.nn.Parameter) -> torch.Tensor:
        return torch.zeros(self.shape(param), dtype=torch.float32)

    def prepare_state(self, step: int) -> None:
        """Create Adam state (so that moments can be written) on an engine that has not stepped yet."""
        if step == 0:
            return
        flats = ([] if self.stage == 0 else
                 self.optimizer.fp32_partitioned_groups_flat if self.stage == 3 else
                 self.optimizer.single_partition_of_fp32_groups)
        owners = ([] if self.stage == 0 else
                  self.optimizer.fp16_groups if self.stage == 3 else self.optimizer.bit16_groups)
        for flat, params in zip(flats, owners):
            state = self.inner.state.setdefault(flat, {})
            for key in moments_of(params[0]):
                state.setdefault(key, torch.zeros_like(flat))
            state["step"] = torch.tensor(float(step))
        if self.stage in (1, 2):
            self._relink()

    def set(self, param: torch.nn.Parameter, value: torch.Tensor, moments: dict[str, torch.Tensor], step: int) -> None:
        """Write this rank's shard's fp32 value (and, after ``step`` > 0 steps, its moments) into the engine."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        # modifier_rank is a rank *inside* the parameter's ZeRO group (the data-parallel group), which DeepSpeed maps
        # to a global rank itself: its first member, whatever this rank's tp/pp coordinates. A global rank here fails
        # as soon as dp == 1 and this rank is not global rank 0 ("Group rank 1 is not part of group").
        if not self.trains and self.stage == 3:
            with gathered([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype))
            return
        if self.stage == 0 or not self.trains:
            param.data.copy_(value.to(param.dtype))
            if step:
                self.optimizer.state[param] = {"step": torch.tensor(float(step)),
                                               **{k: v.clone() for k, v in moments.items()}}
            return
        safe_set_full_fp32_param(param, value)
        if step:
            for key, moment in moments.items():
                safe_set_full_optimizer_state(param, moment, key)
        if self.stage == 3:  # the bf16/fp32 working partition, from the same full value on every dp rank
            with gathered([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype))

    def finish(self) -> None:
        """Refresh the working (bf16/fp32) copies from the fp32 masters after a load (ZeRO 1-2)."""
        if self.stage in (1, 2) and self.trains:
            self.optimizer.update_lp_params()

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (empty for an engine built to evaluate)."""
        return list(getattr(self.optimizer, "param_groups", []))
