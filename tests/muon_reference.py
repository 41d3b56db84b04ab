"""The Muon tests' one-process reference, built from torch's own optimizers and written here, independently of the
package's ``MuonWithAdamW``: ``torch.optim.Muon`` for the blocks' weight matrices (each expert of a stacked expert
weight as a matrix of its own), ``torch.optim.AdamW`` for the rest (weight decay on matrices only), one warm-up +
cosine schedule for both. Muon's authors' split, Moonshot's LR rule (``match_rms_adamw``) and Nesterov momentum 0.95
are the hyperparameters ``LLMModule(optimizer="muon")`` documents."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn
from torch.optim import _muon as torch_muon


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (torch 2.13's ``_zeropower_via_newtonschulz``) in fp32:
    torch runs it in bf16 only, whose rounding makes layouts that sum gradients in another order drift apart."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def fp32_newton_schulz() -> Iterator[None]:
    """``torch.optim.Muon`` with its Newton-Schulz iteration in fp32 (torch fixes bf16; the chain asks for fp32)."""
    kept = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = kept


def is_block_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon's share: a weight of 2 or more dimensions inside ``layers.N.``, the router excepted."""
    return name.startswith("layers.") and param.dim() >= 2 and ".router." not in name


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 down to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TorchMuonAndAdamW:
    """Both torch optimizers and their schedules behind ``step``/``zero_grad`` (the reference loops' interface). A
    stacked expert weight ``[E, n, m]`` is stepped as E matrices: each its own leaf tensor for ``torch.optim.Muon``
    (momentum kept per expert), its gradient copied in before the step and its value copied back after."""

    def __init__(self, model: nn.Module, optim: dict) -> None:
        named = list(model.named_parameters())
        blocks = [p for n, p in named if is_block_matrix(n, p)]
        self.stacks = [(p, [p.detach()[e].clone().requires_grad_() for e in range(p.shape[0])])
                       for p in blocks if p.dim() == 3]
        matrices = [p for p in blocks if p.dim() == 2] + [m for _, ms in self.stacks for m in ms]
        rest = [(n, p) for n, p in named if not is_block_matrix(n, p)]
        lr, decay = optim["lr"], optim["weight_decay"]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=decay, momentum=optim.get("muon_momentum", 0.95),
                                     nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": decay},
                                        {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=lr, betas=(0.9, 0.95), eps=1e-8)
        factor = lambda step: warmup_cosine(step, optim["warmup_steps"], optim["max_steps"], optim["min_lr_ratio"])
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (self.muon, self.adamw)]

    @torch.no_grad()
    def step(self) -> None:
        for stack, experts in self.stacks:
            for e, matrix in enumerate(experts):
                matrix.grad = stack.grad[e].clone()
        with fp32_newton_schulz():
            self.muon.step()
        self.adamw.step()
        for stack, experts in self.stacks:
            for e, matrix in enumerate(experts):
                stack[e].copy_(matrix)
        for schedule in self.schedules:
            schedule.step()

    def zero_grad(self) -> None:
        for optimizer in (self.muon, self.adamw):
            optimizer.zero_grad()
        for stack, _ in self.stacks:
            stack.grad = None


class _NoSchedule:
    """The loops step a scheduler after the optimizer: :class:`TorchMuonAndAdamW` steps its own."""

    def step(self) -> None:
        pass


def torch_muon_and_adamw(model: nn.Module, optim: dict) -> tuple[TorchMuonAndAdamW, _NoSchedule]:
    """(the optimizer, the scheduler) of the reference loops, for ``optim`` (the ``LLMModule`` keywords)."""
    if optim.get("muon_ns_dtype") != "float32":
        raise ValueError(f"muon_ns_dtype={optim.get('muon_ns_dtype')!r}: the reference is written for 'float32'")
    return TorchMuonAndAdamW(model, optim), _NoSchedule()
