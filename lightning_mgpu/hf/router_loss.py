"""The model's own load-balancing loss (``output_router_logits=True``, ``router_aux_loss_coef``) on a layout that
splits the tokens one process sees (context and sequence parallelism) or its layers (pipeline stages).

What ``transformers`` computes (``load_balancing_loss_func``, the same function in every family that has one): over
every layer's router logits of the call's tokens (padding left out where an attention mask is given), ``T_e`` the share
of top-k assignments that went to expert ``e`` (no gradient) and ``P_e`` the mean routing probability of ``e``; the loss
is ``num_experts * sum_e T_e * P_e``, added times the model's ``router_aux_loss_coef`` in its causal LM's ``forward``.
A product of means over all layers and all tokens does not split into per-rank or per-stage terms, so the sums behind
the means (assignments and rows as integers, probabilities in fp32) are formed where the logits are and reduced or
carried to where the loss is formed:

* context ranks hold parts of every sequence: the sums are all-reduced over the context group, the probabilities' with
  an all-reduce of the gradient backward. Each context rank's loss holds the whole term and the strategy averages the
  ranks' gradients, so each rank's tokens get ``C`` times the term's gradient, divided by ``C``: one process's;
* sequence parallelism: each tensor-parallel rank routes its sequence shard and every rank's loss is the same (not
  averaged); the router's gradient is summed over the ranks (``grad_sum_sp``), so the probabilities' all-reduce is
  the identity backward (Megatron's reduce-from-region);
* pipeline stages: each stage adds its layers' sums to those it received and hands them on with the hidden states
  (the probabilities' sum requires grad, so its gradient returns through the pipeline's own backward sends; the counts
  are integers, which carry none); the last stage forms the loss, and the pipeline loss adds it times the coefficient.
  Each pipeline micro-batch is one call of the model, as one process accumulating gradients over the same micro-batches.

Written here because ``transformers``' function takes one call's logits and no process group, and torch's
differentiable all-reduce (``torch.distributed.nn.functional.all_reduce``) is deprecated in torch 2.13 while the
functional collectives' ``all_reduce`` has no autograd. The routers, their logits (``transformers``' own output
capture, ``router_logits``), the number of experts, the top-k and the coefficient are the model's.
"""

from __future__ import annotations

import inspect
import sys
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.regions import ReduceFromRegion
from lightning_mgpu.problems import Problem

#: Where the wiring is kept on the causal LM (read by its pipeline stages and the pipeline loss).
ATTRIBUTE = "mgpu_router_loss"
#: The causal LM's attributes its ``forward`` reads for the loss (the same in every family that has one).
MODEL_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
#: The parameters of ``load_balancing_loss_func`` where it forms the loss as described above (Mixtral's, copied by
#: Qwen-MoE, gpt-oss, OLMoE, GraniteMoE, ...); Doge's routes by product keys (``num_keys``) and is refused.
LOSS_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")
#: How many of the latest micro-batches' values :attr:`RouterLoss.values` keeps.
KEPT_VALUES = 64


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, all-reduce of the gradient backward: the adjoint of a sum whose every rank's copy
    enters its own rank's loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def splits_tokens_or_layers(layout: ParallelLayout) -> bool:
    """Whether one call of the model sees fewer tokens (context, sequence parallelism) or layers (pipeline stages)
    than one process's call would."""
    return layout.size("pp") > 1 or layout.size("cp") > 1 or layout.sequence_parallel


def router_loss_problems(found: HFModel, layout: ParallelLayout) -> list[Problem]:
    """A model whose causal LM computes its load-balancing loss other than ``transformers``' MoE families do (without
    ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``, or without ``load_balancing_loss_func``
    beside it) cannot have it formed over the whole sequence and every stage: refused where the layout splits them."""
    if not getattr(found.config, "output_router_logits", False) or not splits_tokens_or_layers(layout):
        return []
    if supported(found.model):
        return []
    name = type(found.model).__name__
    axes = [f"{key}={value}" for key, value, on in (
        ("pipeline_parallel_size", layout.size("pp"), layout.size("pp") > 1),
        ("context_parallel_size", layout.size("cp"), layout.size("cp") > 1),
        ("sequence_parallel", True, layout.sequence_parallel)) if on]
    return [Problem("output_router_logits", True, f"with {name}: its load-balancing loss is not formed as "
                    f"transformers' mixtures of experts form it ({', '.join(MODEL_ATTRIBUTES)} and "
                    f"load_balancing_loss_func), so it cannot be formed over the tokens and layers that "
                    f"{' and '.join(axes)} split",
                    "set the model's config.output_router_logits=False, or a layout without "
                    f"{', '.join(a.split('=')[0] for a in axes)}")]


def supported(model: nn.Module) -> bool:
    """Whether ``model`` forms its load-balancing loss as :mod:`this module <lightning_mgpu.hf.router_loss>` does."""
    module = sys.modules.get(type(model).__module__)
    function = getattr(module, "load_balancing_loss_func", None)
    if function is None or not all(hasattr(model, name) for name in MODEL_ATTRIBUTES):
        return False
    return tuple(inspect.signature(function).parameters) == LOSS_PARAMETERS


class RouterLoss:
    """The sums behind the model's load-balancing loss on this rank, reduced over the ranks that split its tokens.

    ``shards``: ``(group, rank, size)`` of the tensor-parallel ranks when each routes a sequence shard (sequence
    parallelism); ``context``: the context-parallel group, when there is one. :attr:`values` keeps the latest
    micro-batches' losses formed by a last pipeline stage while training (detached, newest last; the pipeline's shape
    inference at its first step, on made-up inputs, adds one before them)."""

    def __init__(self, model: nn.Module, shards: Optional[tuple[Any, int, int]] = None,
                 context: Optional[Any] = None) -> None:
        self.model, self.shards, self.context = model, shards, context
        self.values: deque[torch.Tensor] = deque(maxlen=KEPT_VALUES)
        self.pending: list[tuple[bool, Optional[torch.Tensor]]] = []

    @property
    def num_experts(self) -> int:
        return int(self.model.num_experts)

    @property
    def coefficient(self) -> float:
        return float(self.model.router_aux_loss_coef)

    def local_mask(self, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The rows of an attention mask ``[batch, seq]`` that this rank's router logits hold, flattened."""
        if mask is None:
            return None
        if self.shards is not None:
            _, rank, size = self.shards
            per = mask.shape[1] // size
            mask = mask.narrow(1, rank * per, per)
        return mask.reshape(-1)

    def zeros(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty sums: ``(counts, probabilities)`` as :meth:`statistics` gives them."""
        E = self.num_experts
        return (torch.zeros(E + 1, dtype=torch.int64, device=device),
                torch.zeros(E, dtype=torch.float32, device=device))

    def statistics(self, logits: Sequence[torch.Tensor], mask: Optional[torch.Tensor],
                   start: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``start`` plus each layer's sums: ``(counts, probabilities)``, the top-k assignments per expert with the
        number of rows last (``int64 [E + 1]``) and the routing probabilities per expert (``fp32 [E]``), padding rows
        left out (``transformers`` weighs them by the mask, which is 0 or 1)."""
        E, k = self.num_experts, int(self.model.num_experts_per_tok)
        counts, probs = start
        flat = self.local_mask(mask)
        for layer in logits:
            weights = F.softmax(layer, dim=-1)
            chosen = torch.topk(weights, k, dim=-1).indices
            if flat is not None:
                keep = flat.to(layer.device) != 0
                chosen, weights = chosen[keep], weights * flat.to(layer.device, torch.float32).unsqueeze(-1)
            rows = torch.full((1,), chosen.shape[0], dtype=torch.int64, device=counts.device)
            counts = counts + torch.cat([torch.bincount(chosen.reshape(-1), minlength=E), rows])
            probs = probs + weights.float().sum(dim=0)
        return counts, probs

    def loss(self, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the whole sequence from this rank's sums."""
        counts = counts.clone()
        for group in [g for g in (self.shards[0] if self.shards else None, self.context) if g is not None]:
            dist.all_reduce(counts, group=group)
        if self.shards is not None:
            probs = ReduceFromRegion.apply(probs, self.shards[0])
        if self.context is not None:
            probs = SumOverRanks.apply(probs, self.context)
        E = self.num_experts
        rows = counts[E].to(torch.float32)
        return torch.sum((counts[:E].to(torch.float32) / rows) * (probs / rows)) * E

    def record(self, value: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.values.append(value.detach())

    def before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The causal LM's forward pre-hook: whether this call forms the loss (its ``output_router_logits``, else the
        config's) and its attention mask, kept for :meth:`after_call`; the model itself forms none."""
        wanted = kwargs.get("output_router_logits")
        wanted = getattr(self.model.config, "output_router_logits", False) if wanted is None else wanted
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.pending.append((bool(wanted), mask))
        return args, {**kwargs, "output_router_logits": False}

    def after_call(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        """The causal LM's forward hook: its output with the loss over the whole sequence as ``aux_loss``, added times
        the model's coefficient to ``loss`` where labels made one, as the model's own ``forward`` adds it."""
        wanted, mask = self.pending.pop()
        if not wanted:
            return out
        logits = getattr(out, "router_logits", None)
        if logits is None:
            raise TypeError(f"{type(self.model).__name__} returned {type(out).__name__} without router_logits: call "
                            "it with return_dict=True so that its load-balancing loss can be formed over every rank")
        aux = self.loss(*self.statistics(logits, mask, self.zeros(logits[0].device)))
        fields = {**out, "aux_loss": aux}
        if out.loss is not None:
            fields["loss"] = out.loss + self.coefficient * aux.to(out.loss.device)
        return type(out)(**fields)


    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The decoder's forward pre-hook: its routers' logits are captured (``transformers``' own output capture)
        where the call around it forms the loss (:meth:`before_call`), and always within pipeline stages."""
        wanted = self.pending[-1][0] if self.pending else True
        return args, {**kwargs, "output_router_logits": wanted}


def wire_router_loss(found: HFModel, layout: ParallelLayout) -> Optional[RouterLoss]:
    """Form ``found``'s load-balancing loss over the whole sequence and every layer on ``layout`` (nothing to do when
    one call sees every token and layer): kept on the causal LM as :data:`ATTRIBUTE` for its pipeline stages (where
    the config asks for the loss: a call under stages takes no ``output_router_logits``), or hooked around its
    ``forward`` without pipeline stages, where a call may ask for it even with the config's ``False``. A model that
    forms it otherwise refuses a call that asks for it (:func:`_refuse_asked_in_the_call`)."""
    configured = getattr(found.config, "output_router_logits", False)
    if not splits_tokens_or_layers(layout) or (layout.size("pp") > 1 and not configured):
        return None
    if not supported(found.model):
        if layout.size("pp") == 1:
            found.model.register_forward_pre_hook(_refuse_asked_in_the_call, with_kwargs=True)
        return None
    shards = (layout.group("tp"), layout.rank("tp"), layout.size("tp")) if layout.sequence_parallel else None
    router = RouterLoss(found.model, shards, layout.group("cp") if layout.size("cp") > 1 else None)
    found.base.register_forward_pre_hook(router.capture, with_kwargs=True)
    if layout.size("pp") == 1:
        found.model.register_forward_pre_hook(router.before_call, with_kwargs=True)
        found.model.register_forward_hook(router.after_call, with_kwargs=True)
    setattr(found.model, ATTRIBUTE, router)
    return router


def _refuse_asked_in_the_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A causal LM that forms its load-balancing loss otherwise than :func:`supported` ones, called with
    ``output_router_logits=True`` on ranks that each see part of the sequence (the config's ``True`` is refused
    before launch by :func:`router_loss_problems`)."""
    if kwargs.get("output_router_logits"):
        raise ValueError(f"output_router_logits=True in the call of {type(module).__name__}: its load-balancing loss "
                         "is not formed as transformers' mixtures of experts form it, so on this layout each rank "
                         "would form it over its own part of the sequence; leave it out of the call, or use a layout "
                         "without context or sequence parallelism")


def last_stage_loss(model: nn.Module, output: Any, causal_lm_loss: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """The pipeline loss of one micro-batch: the model's causal-LM loss of the last stage's logits, plus the model's
    coefficient times the load-balancing loss the stage formed, when it hands on ``(logits, that loss)``."""
    if isinstance(output, torch.Tensor):
        return causal_lm_loss(output)
    logits, aux = output[0], output[1].reshape(())
    router: RouterLoss = getattr(model, ATTRIBUTE)
    router.record(aux)
    return causal_lm_loss(logits) + router.coefficient * aux
