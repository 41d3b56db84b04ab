"""Mixture-of-experts feed-forward layers for the Llama decoder: a deterministic fp32 router, experts stacked into 3-D
weights run by one grouped matrix multiplication, optional shared experts, and the load-balancing losses.

Architecture only: nothing distributed is imported. What expert, tensor, context or data parallelism changes (where
tokens travel, which partial sums are added, over which ranks the balancing statistics are summed) is one
:class:`MoEWiring` object set on each layer from outside (``lightning_mgpu.parallel.experts``); the default wiring is
one process.

The balancing losses reach the router through :class:`LossGradient`: the block's output carries them, and in backward
their gradient (a constant, ``loss_scale``) is injected, so they reach every router from inside its own block's
backward, wherever the block runs (any pipeline stage, any schedule) and without being added to the final loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

ROUTER_SCORES = ("softmax", "sigmoid")
#: Which tokens the auxiliary loss's statistics count: none; every token of the micro-batch; each sequence apart
#: (DeepSeek-V3's sequence-wise loss); every token of the micro-batch over all data-parallel ranks.
AUX_LOSSES = ("none", "micro_batch", "sequence", "global_batch")


#: Fields of a Llama config that only a mixture-of-experts model uses, with their dense-model defaults.
MOE_OPTIONS = {"experts_per_token": 2, "expert_hidden": 0, "shared_experts": 0, "dense_layers": 0,
               "router_score": "softmax", "router_renormalize": True, "router_scale": 1.0, "capacity_factor": None,
               "aux_loss": "micro_batch", "aux_loss_coeff": 0.01, "z_loss_coeff": 0.0, "router_bias_rate": 0.0}


def moe_problems(cfg: Any) -> list[str]:
    """Every reason the mixture-of-experts fields of ``cfg`` (a ``LlamaConfig``) cannot work, worded with the field."""
    if cfg.num_experts == 0:
        set_ = [f"{k}={getattr(cfg, k)!r}" for k, v in MOE_OPTIONS.items() if getattr(cfg, k) != v]
        return [f"{', '.join(set_)} only apply to a mixture-of-experts model: set num_experts > 0 or remove "
                f"{'them' if len(set_) > 1 else 'it'}"] if set_ else []
    problems = []
    if cfg.num_experts < 0:
        problems.append(f"num_experts={cfg.num_experts} must be 0 (dense) or positive")
    if not 1 <= cfg.experts_per_token <= max(cfg.num_experts, 1):
        problems.append(f"experts_per_token={cfg.experts_per_token} must be between 1 and num_experts="
                        f"{cfg.num_experts}")
    if not 0 <= cfg.dense_layers < cfg.n_layers:
        problems.append(f"dense_layers={cfg.dense_layers} must be in [0, n_layers={cfg.n_layers}): at least one "
                        "layer must be a mixture of experts")
    if cfg.router_score not in ROUTER_SCORES:
        problems.append(f"router_score={cfg.router_score!r} is unknown; choose {' or '.join(ROUTER_SCORES)}")
    if cfg.aux_loss not in AUX_LOSSES:
        problems.append(f"aux_loss={cfg.aux_loss!r} is unknown; choose one of {', '.join(AUX_LOSSES)}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        problems.append(f"capacity_factor={cfg.capacity_factor} cannot keep any token: give a factor > 0 (1.0 keeps "
                        "an even share per expert, 1.25 is common), or None (dropless)")
    for name in ("aux_loss_coeff", "z_loss_coeff", "router_bias_rate", "shared_experts"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name}={getattr(cfg, name)} must be >= 0")
    return problems


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[rows of expert e] @ w[e]`` for rows grouped by expert (``counts[e]`` rows each, in expert order).

    ``torch._grouped_mm`` where it runs (CPU in any float dtype, CUDA in bf16, rows a multiple of 16 bytes); otherwise
    each expert's rows padded to the largest group and one batched matmul (no loop over experts either way)."""
    if _grouped_mm_runs(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x.contiguous(), w, offs=offsets)
    return _padded_matmul(x, w, counts)


class GroupedMatmul:
    """How :class:`GroupedExperts` multiplies a stacked weight: :func:`grouped_matmul` in the weights' precision. A
    precision setting replaces it (fp8: ``lightning_mgpu.fp8``); ``name`` is the weight's, ``token_groups``
    ``[experts, sources]`` counts each expert's rows by the rank they came from."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, name: str,
                 token_groups: Optional[torch.Tensor] = None) -> torch.Tensor:
        return grouped_matmul(x, w, counts)


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    aligned = all(n * x.element_size() % 16 == 0 for n in (w.shape[1], w.shape[2]))
    dtype_ok = x.device.type == "cpu" or x.dtype == torch.bfloat16
    return hasattr(torch, "_grouped_mm") and aligned and dtype_ok and x.device.type != "meta"


def _padded_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    E, rows = w.shape[0], x.shape[0]
    width = int(counts.max()) if rows else 0
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=rows)
    slot = torch.arange(rows, device=x.device) - starts[expert]
    padded = x.new_zeros(E, width, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


@dataclass
class Route:
    """Where the tokens of one layer go: per token its experts ``[T, k]`` and their weights ``[T, k]``; the balancing
    losses' term (already scaled by their coefficients) and what the layer reports."""

    experts: torch.Tensor
    weights: torch.Tensor
    loss: torch.Tensor
    stats: dict


class MoEWiring:
    """How a layer's tokens and partial results travel: one process (every method the identity).

    ``lightning_mgpu.parallel.experts`` subclasses it for expert, tensor and context parallelism."""

    #: The local experts are ``[first_expert, first_expert + local experts)`` of the layer's experts.
    first_expert: int = 0

    def statistics_ranks(self, aux_loss: str) -> int:
        """How many ranks' tokens ``aux_loss``'s statistics sum over (their gradient is scaled by it: ``Router``)."""
        return 1

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum_statistics(self, t: torch.Tensor, aux_loss: str) -> torch.Tensor:
        """``t`` summed over the ranks whose tokens ``aux_loss``'s statistics count (forward only: backward is the
        identity, every rank computes the same loss from the sum)."""
        return t

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(tokens for this rank's experts grouped by local expert, their counts, what :meth:`combine` needs), from
        ``tokens`` grouped by expert with ``counts[e]`` tokens for expert ``e`` of all experts."""
        return tokens, counts, None

    def token_groups(self, counts: torch.Tensor, handle: Any) -> torch.Tensor:
        """``[local experts, sources]``: how many of each local expert's rows (``counts``) came from each rank."""
        return counts.view(-1, 1)

    def combine(self, outputs: torch.Tensor, handle: Any) -> torch.Tensor:
        """The experts' outputs back in the order :meth:`dispatch` was given its tokens."""
        return outputs

    def expert_output(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' outputs made whole (tensor parallelism sums the partial products of hidden shards)."""
        return y

    def shared_output(self, y: torch.Tensor) -> torch.Tensor:
        """The shared experts' partial outputs summed into what the block returns."""
        return y

    def block_output(self, y: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined (whole) output as the block returns it (a sequence shard under sequence
        parallelism)."""
        return y


class LossGradient(torch.autograd.Function):
    """``x`` unchanged forward; backward, ``scale`` as the gradient of ``loss`` (a scalar), so that ``loss`` is
    minimised as if added to the training loss, wherever that loss is computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full(ctx.loss_shape, ctx.scale, dtype=torch.float32), None


class RouterGate(nn.Linear):
    """The router's projection, computed in fp32 whatever the weights' and activations' dtype (a module of its own, so
    that an engine that gathers a module's weights when it is called, ZeRO-3, gathers it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Router(nn.Module):
    """Top-k routing computed in fp32, deterministically: experts ranked by a stable sort (ties go to the lower
    expert index), no noise. With ``bias_rate > 0`` a per-expert bias (auxiliary-loss-free balancing, DeepSeek-V3)
    shifts which experts are chosen but not their weights; :meth:`update_bias` moves it once per optimizer step."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.gate = RouterGate(cfg.dim, cfg.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32, device="cpu"),
                             persistent=cfg.router_bias_rate > 0)
        #: Tokens routed to each expert since the last bias update (this rank's training forwards, summed over
        #: micro-batches); integers, which a module's dtype conversion leaves alone.
        self.register_buffer("step_counts", torch.zeros(cfg.num_experts, dtype=torch.long, device="cpu"),
                             persistent=False)
        #: The gradient given to the balancing losses (1 / micro-batches of a step, times a loss scale); set per step.
        self.loss_scale = 1.0
        self.routes: Optional[torch.Tensor] = None  #: the experts chosen in the last forward ``[T, k]``

    def forward(self, x: torch.Tensor, batch: int, wiring: MoEWiring) -> Route:
        """``x``: ``[T, dim]`` tokens, ``batch`` sequences of ``T / batch`` tokens each."""
        logits = self.gate(wiring.router_input(x))
        scores = torch.softmax(logits, -1) if self.cfg.router_score == "softmax" else torch.sigmoid(logits)
        choice = scores + self.expert_bias.to(scores.device) if self.cfg.router_bias_rate > 0 else scores
        ranked, order = torch.sort(choice.detach(), dim=-1, descending=True, stable=True)
        experts = order[:, : self.top_k]
        weights = scores.gather(-1, experts)
        if self.cfg.router_renormalize and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        weights = weights * self.cfg.router_scale
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        # counted once per training forward: not in evaluation, not when recomputed inside backward (checkpointing)
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                self.step_counts += counts.to(self.step_counts)
        loss, stats = self._losses(logits, scores, experts, batch, wiring)
        margin = (ranked[:, self.top_k - 1] - ranked[:, self.top_k]).min() if self.top_k < self.num_experts \
            else ranked.new_tensor(float("inf"))
        self.routes = experts.detach()
        stats.update(counts=counts.detach(), margin=margin.detach())
        return Route(experts, weights, loss, stats)

    def _losses(self, logits: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, batch: int,
                wiring: MoEWiring) -> tuple[torch.Tensor, dict]:
        cfg, zero = self.cfg, logits.new_zeros(())
        aux = zero
        if cfg.aux_loss != "none" and cfg.aux_loss_coeff > 0:
            aux = balance_loss(scores, experts, batch, cfg.aux_loss, cfg.router_score, wiring)
        z = logits.logsumexp(-1).square().mean() if cfg.z_loss_coeff > 0 else zero
        # A loss of the summed statistics is the same number on every rank that summed them, and each such rank adds
        # only its own tokens' share of the gradient: the data-parallel mean divides that by the ranks, so scale back.
        loss = cfg.aux_loss_coeff * aux * wiring.statistics_ranks(cfg.aux_loss) + cfg.z_loss_coeff * z
        return loss, {"aux_loss": aux.detach(), "z_loss": z.detach()}

    @override
    def _apply(self, fn, recurse: bool = True):
        """The bias stays fp32 whatever dtype the module is cast to: steps of ``router_bias_rate`` (1e-3) vanish in
        bf16 once the bias nears 0.5."""
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        return self

    @torch.no_grad()
    def update_bias(self, total_counts: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: raise the bias of experts that got fewer tokens than the mean, lower the
        others, by ``router_bias_rate`` (``total_counts``: summed over the step and every data/context rank, the same
        on every rank, so every rank moves its bias alike)."""
        if self.cfg.router_bias_rate > 0:
            error = total_counts.float().mean() - total_counts.float()
            self.expert_bias += self.cfg.router_bias_rate * torch.sign(error).to(self.expert_bias)
        self.step_counts.zero_()


def balance_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int, kind: str, score_func: str,
                 wiring: MoEWiring) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss ``E * sum_e f_e * P_e``: ``f_e`` the fraction of assignments to expert
    ``e``, ``P_e`` its mean (normalised) score, over the tokens ``kind`` counts (each sequence apart for
    ``sequence``, then averaged); 1 when perfectly balanced. Statistics are summed over the ranks holding the rest of
    those tokens (``wiring.sum_statistics``)."""
    T, E = scores.shape
    probs = scores / scores.sum(-1, keepdim=True) if score_func == "sigmoid" else scores
    groups = batch if kind == "sequence" else 1
    one_hot = torch.zeros_like(scores).scatter_(-1, experts, 1.0)
    counts = one_hot.view(groups, -1, E).sum(1)  # [groups, E]
    prob_sums = probs.view(groups, -1, E).sum(1)
    tokens = counts.new_full((groups, 1), T // groups)
    counts, tokens = wiring.sum_statistics(torch.cat([counts, tokens], -1), kind).split([E, 1], -1)
    prob_sums = wiring.sum_statistics(prob_sums, kind)
    k = experts.shape[1]
    per_group = E * (counts / (tokens * k) * prob_sums / tokens).sum(-1)
    return per_group.mean()


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts in three stacked weights (``w1``, ``w3``: ``[E, dim, hidden]``; ``w2``:
    ``[E, hidden, dim]``), run on tokens grouped by expert with one grouped matmul each."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.matmul = GroupedMatmul()

    def forward(self, x: torch.Tensor, counts: torch.Tensor, token_groups: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        mm = self.matmul
        h = F.silu(mm(x, self.w1, counts, "w1", token_groups)) * mm(x, self.w3, counts, "w3", token_groups)
        return mm(h, self.w2, counts, "w2", token_groups)


class MoEFeedForward(nn.Module):
    """Routed experts (and optional shared experts, which see every token) in place of a block's SwiGLU MLP.

    Dropless by default; with ``capacity_factor`` each expert takes at most ``ceil(capacity_factor * T * k / E)`` of
    the ``T`` tokens it is given here (the first ones, in token order), the rest of its assignments are dropped (their
    weight is lost; the shared experts and the residual still carry the token). ``T`` is what this rank holds, so
    which tokens drop depends on the layout."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_ffn_hidden)
        self.shared_experts = GroupedExperts(1, cfg.dim, cfg.expert_ffn_hidden * cfg.shared_experts) \
            if cfg.shared_experts else None
        self.wiring = MoEWiring()
        self.stats: dict = {}
        self.shapes_only = False  #: pass the input through (see :func:`shapes_only`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta" or self.shapes_only:  # only the output's shape is wanted: no routes, no exchange
            return self.wiring.block_output(x)
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        route = self.router(flat, b, self.wiring)
        order, counts, dropped = self._assignments(route.experts, flat.shape[0])
        tokens = flat[order // self.cfg.experts_per_token]
        local, local_counts, handle = self.wiring.dispatch(tokens, counts)
        groups = self.wiring.token_groups(local_counts, handle)
        y = self.wiring.combine(self.wiring.expert_output(self.experts(local, local_counts, groups)), handle)
        weighted = y * route.weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        out = self.wiring.block_output(flat.new_zeros(flat.shape).index_add(0, order // self.cfg.experts_per_token,
                                                                              weighted).view(b, s, d))
        if self.shared_experts is not None:
            everyone = flat.new_tensor([flat.shape[0]], dtype=torch.long)
            out = out + self.wiring.shared_output(self.shared_experts(flat, everyone).view(b, s, d))
        self.stats = dict(route.stats, dropped=dropped)
        return LossGradient.apply(out, route.loss, self.router.loss_scale)

    def _assignments(self, experts: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the kept token-expert assignments ordered by expert, then token; tokens per expert; fraction dropped)."""
        E, k = self.cfg.num_experts, self.cfg.experts_per_token
        flat = experts.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=E)
        if self.cfg.capacity_factor is None:
            return order, counts, flat.new_zeros((), dtype=torch.float32)
        capacity = math.ceil(self.cfg.capacity_factor * T * k / E)
        starts = counts.cumsum(0) - counts
        slot = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        keep = slot < capacity
        kept = counts.clamp(max=capacity)
        return order[keep], kept, 1.0 - kept.sum().float() / max(flat.numel(), 1)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """Every mixture-of-experts layer of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


@contextlib.contextmanager
def shapes_only(layers: list[MoEFeedForward]) -> Iterator[None]:
    """Inside it, ``layers`` pass their input through: for a forward run only to learn output shapes (a pipeline
    stage's first), whose made-up tokens must not be routed, exchanged or counted."""
    for layer in layers:
        layer.shapes_only = True
    try:
        yield
    finally:
        for layer in layers:
            layer.shapes_only = False


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the balancing losses get in the next backward passes (``1 / micro-batches per optimizer step``,
    times the fp16 loss scale), so that they weigh as if added to each micro-batch's loss."""
    for layer in moe_layers(model):
        layer.router.loss_scale = scale
