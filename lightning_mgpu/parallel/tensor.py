"""Megatron-style tensor-parallel layers on plain local-shard parameters.

Each layer is built from an existing full layer (``from_module``) and keeps only this rank's shard of
its weights, so a model initialised (or loaded) whole becomes the same function split over ``T`` ranks.
Parameter names are unchanged (``weight``, ``bias``), so state dicts keep their keys.

Where the collectives sit (per transformer block: two in forward, two in backward):

* a ``ParallelNorm`` is where activations enter the tensor-parallel region: the norm runs on its input
  (a sequence shard under sequence parallelism) and its affine part is fused with the all-gather
  (sequence parallel) or the gradient all-reduce (not), see :class:`~lightning_mgpu.parallel.regions.ScaledGather`;
* ``ColumnParallelLinear`` consumes the region's tensor with no collective and yields sharded features;
  with ``enters_region=True`` it enters the region itself;
* ``RowParallelLinear`` sums its partial products: all-reduce, or reduce-scatter to sequence shards;
* ``VocabParallelEmbedding`` looks up its slice of the vocabulary and sums like a row-parallel layer;
* ``VocabParallelOutput`` yields logits sharded over the vocabulary, for
  :func:`~lightning_mgpu.parallel.cross_entropy.vocab_parallel_cross_entropy`.

Which layers enter the region is decided by the plan, not at run time (a tensor cannot be tagged: ZeRO-3
rewraps module outputs): a column-parallel layer fed directly by a ``ParallelNorm`` uses the style
``colwise``; one fed by anything else uses ``colwise_enter`` and enters the region itself.

Sharded parameters carry ``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride``,
the attributes DeepSpeed reads to count them once per tensor-parallel group in the global grad norm.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.rank_grid import GroupCoordinates
from lightning_mgpu.parallel.regions import (
    CopyToRegion,
    GatherFeatures,
    GatherSequence,
    ReduceFromRegion,
    ReduceScatterSequence,
    ScaledGather,
    SharedBiasBeforeReduce,
    SplitFeatures,
)

def rank_and_size(group: Any) -> tuple[int, int]:
    """(this rank's index, the group's size) of a process group or of :class:`GroupCoordinates`."""
    if isinstance(group, GroupCoordinates):
        return group.rank, group.size
    return dist.get_rank(group), dist.get_world_size(group)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, full_size: int, rank: int) -> nn.Parameter:
    """Tag a shard the way Megatron does, which is what DeepSpeed's grad-norm and checkpoint code reads, plus the
    unpadded size of the whole tensor along ``partition_dim`` and which chunk this is (to reassemble it, or to give it
    its part of an initial value)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.full_size = full_size
    param.partition_rank = rank
    return param


def _shard(tensor: torch.Tensor, dim: int, rank: int, T: int, padded: Optional[int] = None) -> nn.Parameter:
    """This rank's contiguous slice of ``tensor`` along ``dim``, zero-padded to ``padded`` rows first."""
    data = tensor.detach()
    if padded is not None and padded > data.shape[dim]:
        pad_shape = list(data.shape)
        pad_shape[dim] = padded - data.shape[dim]
        data = torch.cat([data, data.new_zeros(pad_shape)], dim=dim)
    return nn.Parameter(data.chunk(T, dim=dim)[rank].clone(), requires_grad=tensor.requires_grad)


def enter_region(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """The tensor every rank of the group needs whole: gathered (sequence parallel) or copied."""
    return GatherSequence.apply(x, group) if sequence_parallel else CopyToRegion.apply(x, group)


def leave_region(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Sum the ranks' partial results: reduce-scattered to sequence shards, or all-reduced."""
    return ReduceScatterSequence.apply(x, group) if sequence_parallel else ReduceFromRegion.apply(x, group)


class TensorParallelLayer(nn.Module):
    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """What the layer multiplies with; a precision setting replaces it per layer (fp8). ``F.linear`` is looked up
        at each call, not bound once: DeepSpeed's ZeRO-3 replaces it with its own, which does not keep the gathered
        weight for backward (bound at import, a 166M-parameter tp2 x pp2 ZeRO-3 rank peaked 5% higher at its step)."""
        return F.linear(x, weight, bias)

    def __init__(self, group: Any, sequence_parallel: bool) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tp_rank, self.tp_size = rank_and_size(group)

    def extra_repr(self) -> str:
        return f"tp={self.tp_rank}/{self.tp_size}, sequence_parallel={self.sequence_parallel}"


class ColumnParallelLinear(TensorParallelLayer):
    """``nn.Linear`` whose output features are split over the group.

    Its input is already in the region (``enters_region=False``, fed by a ``ParallelNorm``), or it
    enters the region itself. With ``gather_output`` every rank gets the whole output (what follows it runs whole on
    every rank: a fused q/k/v projection whose heads a norm over all of them reads, as OLMo 2's).
    """

    def __init__(self, linear: nn.Linear, group: Any, sequence_parallel: bool = False,
                 enters_region: bool = False, gather_output: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.enters_region, self.gather_output = enters_region, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features // self.tp_size
        self.weight = mark_tensor_parallel(_shard(linear.weight, 0, self.tp_rank, self.tp_size), 0,
                                           linear.out_features, self.tp_rank)
        self.bias = None if linear.bias is None else mark_tensor_parallel(
            _shard(linear.bias, 0, self.tp_rank, self.tp_size), 0, linear.out_features, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters_region:
            x = enter_region(x, self.group, self.sequence_parallel)
        y = self.linear(x, self.weight, self.bias)
        return GatherFeatures.apply(y, self.group) if self.gather_output else y


class RowParallelLinear(TensorParallelLayer):
    """``nn.Linear`` whose input features are split over the group; sums the partial products. With ``split_input``
    its input is whole on every rank and each takes its chunk (after a ``gather_output`` column-parallel layer)."""

    def __init__(self, linear: nn.Linear, group: Any, sequence_parallel: bool = False,
                 split_input: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.split_input = split_input
        self.in_features, self.out_features = linear.in_features // self.tp_size, linear.out_features
        self.weight = mark_tensor_parallel(_shard(linear.weight, 1, self.tp_rank, self.tp_size), 1,
                                           linear.in_features, self.tp_rank)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = SplitFeatures.apply(x, self.group)
        partial = self.linear(x, self.weight, None)
        if self.bias is None:
            return leave_region(partial, self.group, self.sequence_parallel)
        if self.sequence_parallel:  # bias before the reduce-scatter keeps its gradient complete
            return leave_region(partial + SharedBiasBeforeReduce.apply(self.bias, self.tp_size), self.group, True)
        return leave_region(partial, self.group, False) + self.bias


class VocabParallelEmbedding(TensorParallelLayer):
    """``nn.Embedding`` split over the vocabulary (padded to a multiple of the group size).

    A ``padding_idx`` (most ``transformers`` configs set ``pad_token_id``) keeps its meaning: its row's gradient is zero
    on the rank that holds it. A scaled word embedding (:func:`embedding_output_scale`) keeps its scale."""

    def __init__(self, embedding: nn.Embedding, group: Any, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        if embedding.max_norm is not None:
            raise ValueError(f"VocabParallelEmbedding does not support max_norm={embedding.max_norm}; build the "
                             "embedding without it")
        self.vocab_size = embedding.num_embeddings
        self.padded_vocab_size = padded_size(self.vocab_size, self.tp_size)
        self.per_rank = self.padded_vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        local_padding = None if embedding.padding_idx is None else embedding.padding_idx - self.vocab_start
        self.local_padding_idx = local_padding if local_padding is not None and 0 <= local_padding < self.per_rank \
            else None
        self.output_scale = embedding_output_scale(embedding)
        self.embedding_dim = embedding.embedding_dim
        self.weight = mark_tensor_parallel(
            _shard(embedding.weight, 0, self.tp_rank, self.tp_size, self.padded_vocab_size), 0, self.vocab_size,
            self.tp_rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = leave_region(out, self.group, self.sequence_parallel)
        if self.output_scale is None:
            return out
        return out * torch.tensor(self.output_scale, dtype=self.weight.dtype, device=out.device)


class VocabParallelOutput(TensorParallelLayer):
    """The language-model head: logits sharded over the (padded) vocabulary, never gathered.

    Logits of padding rows are ``-inf``, so they take no probability in the loss or when sampling.
    """

    def __init__(self, linear: nn.Linear, group: Any, sequence_parallel: bool = False,
                 enters_region: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.enters_region = enters_region
        self.in_features, self.vocab_size = linear.in_features, linear.out_features
        self.padded_vocab_size = padded_size(self.vocab_size, self.tp_size)
        self.per_rank = self.padded_vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = mark_tensor_parallel(
            _shard(linear.weight, 0, self.tp_rank, self.tp_size, self.padded_vocab_size), 0, self.vocab_size,
            self.tp_rank)
        self.bias = None if linear.bias is None else mark_tensor_parallel(
            _shard(linear.bias, 0, self.tp_rank, self.tp_size, self.padded_vocab_size), 0, self.vocab_size,
            self.tp_rank)
        self.num_padding = max(0, min(self.per_rank, self.vocab_start + self.per_rank - self.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters_region:
            x = enter_region(x, self.group, self.sequence_parallel)
        logits = self.linear(x, self.weight, self.bias)
        if self.num_padding:
            keep = torch.arange(self.per_rank, device=logits.device) < self.per_rank - self.num_padding
            logits = logits.masked_fill(~keep, float("-inf"))
        return logits


class ParallelNorm(TensorParallelLayer):
    """A norm whose output enters the tensor-parallel region (feeds column-parallel layers).

    Works for any norm computed as ``normalise(x) * weight (+ bias)`` (RMSNorm, LayerNorm): the wrapped
    module computes ``normalise(x)`` with its weight replaced by ones (and bias by zeros), and the affine
    part is fused with the region's collective so that the weight and bias gradients come out complete
    on every rank, also when the norm sees only a sequence shard.
    """

    def __init__(self, norm: nn.Module, group: Any, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.weight = nn.Parameter(norm.weight.detach().clone(), requires_grad=norm.weight.requires_grad)
        bias = getattr(norm, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        # The unit affine is real even when the model is built on the meta device: it is a constant, not a parameter.
        device = torch.device("cpu") if self.weight.is_meta else self.weight.device
        del norm.weight
        norm.register_buffer("weight", torch.ones(self.weight.shape, dtype=self.weight.dtype, device=device),
                             persistent=False)
        if bias is not None:
            del norm.bias
            norm.register_buffer("bias", torch.zeros(self.bias.shape, dtype=self.bias.dtype, device=device),
                                 persistent=False)
        self.normalize = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.normalize
        if norm.weight.dtype != self.weight.dtype or norm.weight.device != self.weight.device:
            # the unit affine follows the real parameters when an engine casts or moves only parameters
            norm.weight = torch.ones_like(self.weight)
            if self.bias is not None:
                norm.bias = torch.zeros_like(self.bias)
        x_hat = self.normalize(x)
        return ScaledGather.apply(x_hat, self.weight, self.bias, self.group, self.sequence_parallel)


def embedding_output_scale(embedding: nn.Embedding) -> Optional[float]:
    """The constant an ``nn.Embedding`` subclass multiplies its lookup by, or None for a plain embedding.

    ``transformers``' scaled word embeddings (Gemma's ``sqrt(hidden_size)``) override ``forward`` only to multiply by
    it; they keep it as the float ``scalar_embed_scale`` and as a buffer ``embed_scale``, which a meta-device build
    leaves without a value, so the float is read first."""
    if type(embedding).forward is nn.Embedding.forward:
        return None
    scale = getattr(embedding, "scalar_embed_scale", None)
    if scale is None and isinstance(getattr(embedding, "embed_scale", None), torch.Tensor) \
            and not embedding.embed_scale.is_meta:
        scale = embedding.embed_scale.item()
    return None if scale is None else float(scale)


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple
