"""Expert parallelism folded over the data x context ranks, composed with tensor parallelism.

Each mixture-of-experts layer (``lightning_mgpu.models.moe``) keeps ``num_experts / Ep`` whole experts on each rank
of its expert-parallel group (``layout.group("ep")``: ``Ep`` consecutive data x context ranks), each expert's hidden
width split over the tensor-parallel ranks like the dense MLP's (``w1``/``w3`` by columns, ``w2`` by rows). The
router is replicated. A token's assignments travel to the rank holding their expert and back by
``all_to_all_single`` with uneven splits (autograd through ``all_to_all_single_autograd``).

Tensor parallelism: the layer's input comes whole from the ``norm`` style's region (gathered under sequence
parallelism), whose backward sums the ranks' gradients. The experts' input gradients are partial (a hidden slice
each) and sum correctly; the router's is whole on every rank, so :class:`ExpertWiring` divides it by ``T`` first.
The experts' partial outputs are all-reduced per assignment before they are weighted, so that the weights' (the
router's) gradient is whole and equal on every tensor-parallel rank, as a replicated parameter's must be: ``k``
times the all-reduce of a dense MLP's output, the price of not summing router gradients over ``T``.

The balancing losses' statistics are summed over the context ranks (the rest of each sequence), and for
``aux_loss="global_batch"`` over every data x context rank.

Collectives issued while autograd runs a backward pass go over ``backward_groups`` where a twin of the group is set
there (``lightning_mgpu.parallel.pipeline_overlap`` sets them, so that a forward and a backward running at once on two
threads never share a group: each group's collectives then come from one thread, in the schedule's order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.models.moe import MoEWiring, moe_layers
from lightning_mgpu.parallel.regions import ReduceFromRegion, ScaleGradient, SplitSequence
from lightning_mgpu.parallel.tensor import leave_region, mark_tensor_parallel, rank_and_size

#: Each stacked expert weight's dimension split over tensor-parallel ranks (its hidden width).
HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}


class ExpertWiring(MoEWiring):
    """Where one layer's tokens and partial results travel on this rank of ``layout`` (groups initialised)."""

    def __init__(self, layout: ParallelLayout, num_experts: int) -> None:
        self.Ep, self.T, self.sp = layout.size("ep"), layout.size("tp"), layout.sequence_parallel
        self.local = num_experts // self.Ep
        self.first_expert = layout.rank("ep") * self.local
        self.ep_group = layout.group("ep") if self.Ep > 1 else None
        self.tp_group = layout.group("tp")
        self.C, self.cp_group = layout.size("cp"), layout.group("cp")
        self.D, self.dp_cp_group = layout.size("dp_cp"), layout.group("dp_cp")
        #: A twin of ``ep``/``dp_cp``'s group used inside backward passes (empty: the same groups everywhere).
        self.backward_groups: dict[str, Any] = {}

    def _group(self, axis: str) -> Any:
        """``axis``'s group, or its twin from ``backward_groups`` while autograd runs a backward (a recomputed
        forward under activation checkpointing included)."""
        own = self.ep_group if axis == "ep" else self.dp_cp_group
        if self.backward_groups and torch._C._current_graph_task_id() != -1:
            return self.backward_groups.get(axis, own)
        return own

    def statistics_ranks(self, aux_loss: str) -> int:
        return self.D if aux_loss == "global_batch" else self.C

    def sum_statistics(self, t: torch.Tensor, aux_loss: str) -> torch.Tensor:
        if self.statistics_ranks(aux_loss) == 1:
            return t
        return ReduceFromRegion.apply(t, self._group("dp_cp") if aux_loss == "global_batch" else self.cp_group)

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleGradient.apply(x, 1.0 / self.T) if self.T > 1 else x

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if self.Ep == 1:
            return tokens, counts, None
        sent = counts.view(self.Ep, self.local)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self._group("ep"))  # [source rank, local expert] counts
        send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = self._all_to_all(tokens, recv_splits, send_splits)
        # Rows arrive grouped by source rank, then expert: regroup them by expert, then source rank.
        expert_of_row = torch.arange(self.local, device=tokens.device).repeat(self.Ep)
        expert_of_row = torch.repeat_interleave(expert_of_row, received.flatten(), output_size=arrived.shape[0])
        order = torch.sort(expert_of_row, stable=True).indices
        return arrived[order], received.sum(0), (order, send_splits, recv_splits, received)

    def token_groups(self, counts: torch.Tensor, handle: Any) -> torch.Tensor:
        return counts.view(-1, 1) if handle is None else handle[3].t()

    def combine(self, outputs: torch.Tensor, handle: Any) -> torch.Tensor:
        if handle is None:
            return outputs
        order, send_splits, recv_splits, _ = handle
        back = outputs[torch.argsort(order)]  # as the rows arrived
        return self._all_to_all(back, send_splits, recv_splits)

    def _all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        if not self.backward_groups:
            return _all_to_all(x, output_splits, input_splits, self._group("ep"))
        return _TwinAllToAll.apply(x, output_splits, input_splits, self)

    def expert_output(self, y: torch.Tensor) -> torch.Tensor:
        return ReduceFromRegion.apply(y, self.tp_group) if self.T > 1 else y

    def shared_output(self, y: torch.Tensor) -> torch.Tensor:
        return leave_region(y, self.tp_group, self.sp) if self.T > 1 else y

    def block_output(self, y: torch.Tensor) -> torch.Tensor:
        return SplitSequence.apply(y, self.tp_group) if self.sp else y


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """``x``'s rows scattered by ``input_splits`` over the group, the rows sent here gathered by ``output_splits``;
    differentiable (the gradient takes the way back)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


class _TwinAllToAll(torch.autograd.Function):
    """:func:`_all_to_all` whose gradient's exchange picks its group when backward runs (the twin). Written here
    because ``all_to_all_single_autograd`` sends the gradient over the group its forward used."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                wiring: ExpertWiring) -> torch.Tensor:
        ctx.splits, ctx.wiring = (output_splits, input_splits), wiring
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=wiring._group("ep"))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.wiring._group("ep"))
        return out, None, None, None


def apply_expert_parallel(module: nn.Module, layout: ParallelLayout) -> list[str]:
    """Keep this rank's experts (and hidden slice) of every mixture-of-experts layer of ``module`` and wire the
    layers for the layout; notes worth reporting (none for a dense model)."""
    layers = moe_layers(module)
    if not layers:
        return []
    for layer in layers:
        layer.wiring = ExpertWiring(layout, layer.cfg.num_experts)
        _keep_experts(layer.experts, layout, layer.cfg.num_experts)
        if layer.shared_experts is not None:
            _keep_experts(layer.shared_experts, layout, 1, shared=True)
    E, Ep = layers[0].cfg.num_experts, layout.size("ep")
    if Ep == 1 and layout.size("tp") == 1:
        return []
    return [f"experts: {len(layers)} layers of {E} experts, {E // Ep} on each rank of {Ep} (expert parallel) x "
            f"hidden / {layout.size('tp')} (tensor parallel)"]


def _keep_experts(experts: nn.Module, layout: ParallelLayout, total: int, shared: bool = False) -> None:
    """Replace each stacked weight by this rank's experts and hidden slice, tagged with where they belong."""
    tp_rank, T = rank_and_size(layout.group("tp"))
    Ep, ep_rank = (1, 0) if shared else (layout.size("ep"), layout.rank("ep"))
    local = total // Ep
    for name, dim in HIDDEN_DIM.items():
        whole = getattr(experts, name)
        per = whole.shape[dim] // T
        if whole.is_meta:
            shape = list(whole.shape)
            shape[0], shape[dim] = local, per
            kept = nn.Parameter(torch.empty(shape, device="meta", dtype=whole.dtype), requires_grad=whole.requires_grad)
        else:
            kept = nn.Parameter(whole.detach().narrow(0, ep_rank * local, local).narrow(dim, tp_rank * per, per)
                                .clone(), requires_grad=whole.requires_grad)
        if T > 1:
            mark_tensor_parallel(kept, dim, whole.shape[dim], tp_rank)
        if Ep > 1:
            kept.expert_partition = (ep_rank, Ep)  # experts [ep_rank * local, (ep_rank + 1) * local) of ``total``
        setattr(experts, name, kept)


def balance_experts(module: nn.Module, layout: ParallelLayout) -> None:
    """After an optimizer step: move each router's bias (auxiliary-loss-free balancing) by the step's token counts
    summed over every data x context rank."""
    move_router_biases(moe_layers(module), layout.group("dp_cp") if layout.size("dp_cp") > 1 else None)


def forget_skipped_step(module: nn.Module) -> None:
    """After an optimizer step the step guard skipped: drop the token counts its batches added to each router, so the
    next bias update counts only the batches of the step it applies (a skipped batch is as if never drawn), and the
    bias stays where it was."""
    for layer in moe_layers(module):
        layer.router.step_counts.zero_()


def move_router_biases(layers: list, group: Any = None) -> None:
    """Move the balancing bias of ``layers`` by their step's token counts summed over ``group`` (one all-reduce for
    all layers; None: this process's counts), so every rank moves it alike; then start counting again."""
    if not any(layer.cfg.router_bias_rate > 0 for layer in layers):
        for layer in layers:
            layer.router.step_counts.zero_()
        return
    counts = torch.stack([layer.router.step_counts for layer in layers])
    if group is not None:
        dist.all_reduce(counts, group=group)
    for layer, total in zip(layers, counts):
        layer.router.update_bias(total)
