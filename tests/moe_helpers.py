"""The single-process reference of a mixture-of-experts run and what the distributed runs record about routing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from helpers import GLOBAL_BATCH, MICRO_BATCH, OPTIM, configured_optimizer, global_batches

from lightning_mgpu import LLMModule
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.models.moe import MoEFeedForward, moe_layers, set_loss_scale

#: A tiny mixture of experts: 4 experts (top-2) and a shared expert in every layer, both balancing losses on.
TINY_MOE = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                       num_experts=4, experts_per_token=2, shared_experts=1, aux_loss_coeff=0.05, z_loss_coeff=0.01)


def moe_reference(token_file: Path, steps: int, model: LlamaConfig = TINY_MOE, chunk: int = MICRO_BATCH,
                  clip: float = 0.3, optim: Optional[dict] = None, groups: Optional[list[list[int]]] = None,
                  optimizers: Optional[Callable] = None) -> dict:
    """A plain loop over whole global batches in chunks of ``chunk`` sequences (what one rank's micro-batch holds,
    so each chunk's balancing statistics are those one rank computes), or in the chunks of sample indices
    ``groups``: the loss and gradient are the means over the chunks. Returns the losses, grad norms, each step's
    routes (per chunk, per layer) and the smallest top-k margin. ``optimizers``: as :func:`helpers.reference`'s."""
    module = LLMModule(model, **(optim or OPTIM), global_batch_size=GLOBAL_BATCH)
    module.configure_model()
    optimizer, scheduler = optimizers(module.model, optim) if optimizers else configured_optimizer(module)
    groups = groups or [list(range(i, i + chunk)) for i in range(0, GLOBAL_BATCH, chunk)]
    chunks = len(groups)
    set_loss_scale(module.model, 1.0 / chunks)
    losses, norms, routes, margins = [], [], [], []
    for batch in global_batches(token_file, steps):
        total, step_routes = 0.0, []
        for part in (batch[index] for index in groups):
            logits = module.model(part[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten())
            (loss / chunks).backward()
            total += loss.item() / chunks
            step_routes.append([layer.router.routes.clone() for layer in moe_layers(module.model)])
            margins += [float(layer.stats["margin"]) for layer in moe_layers(module.model)]
        for layer in moe_layers(module.model):  # the bias moves from the whole step's counts
            layer.router.update_bias(layer.router.step_counts.clone())
        norms.append(torch.nn.utils.clip_grad_norm_(module.model.parameters(), clip).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
        routes.append(step_routes)
    return {"losses": losses, "grad_norms": norms, "routes": routes, "margin": min(margins),
            "experts": expert_weights(module.model), "first_moe_layer": model.dense_layers}


def expert_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every stacked expert weight by its parameter name (whole tensors, on this process)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." in name}


class RouteRecorder(L.Callback):
    """Records, on tensor-parallel rank 0, each router's chosen experts in every training forward: (step, layer
    name, routes); and the layout's expert groups and the experts this rank holds (to assert the layout that ran)."""

    def __init__(self) -> None:
        self.routes: list[tuple[int, str, torch.Tensor]] = []
        self.layers: list = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for name, layer in trainer.strategy.model.module.named_modules():
            if isinstance(layer, MoEFeedForward):
                self.layers.append(layer)
                if trainer.strategy.layout.rank("tp") == 0:  # the other tensor-parallel ranks route the same tokens
                    layer.router.register_forward_hook(self._hook(trainer, _layer_name(name)))

    def _hook(self, trainer: L.Trainer, name: str):
        def record(module, args, route) -> None:
            self.routes.append((trainer.global_step, name, route.experts.detach().clone()))
        return record

    def summary(self, trainer: L.Trainer) -> dict[str, Any]:
        import torch.distributed as dist

        layout = trainer.strategy.layout
        groups = {axis: dist.get_process_group_ranks(layout.group(axis)) for axis in ("ep", "edp")} \
            if layout.size("ep") > 1 else {}
        held = {name[name.index("layers."):]: tuple(getattr(p, "ds_shape", p.shape))
                for name, p in trainer.strategy.model.module.named_parameters() if ".experts." in name}
        first = {layer.wiring.first_expert for layer in self.layers}
        return {"routes": self.routes, "groups": groups, "held": held, "first_expert": first,
                "whole_parameters": trainer.strategy.parameter_counts.total}


def _layer_name(name: str) -> str:
    """``layers.<i>`` of a module name, whatever container (LightningModule, pipeline stage) it sits in."""
    parts = name.split(".")
    return f"layers.{parts[parts.index('layers') + 1]}"


def reference_routes(ref: dict) -> Counter:
    """The reference's routes as a multiset of (step, layer, token's experts)."""
    out: Counter = Counter()
    for step, chunks in enumerate(ref["routes"]):
        for chunk in chunks:
            for layer, routes in enumerate(chunk):
                out.update((step, f"layers.{layer + ref['first_moe_layer']}", tuple(r)) for r in routes.tolist())
    return out


def assert_routes_equal(results: list[dict], ref: dict) -> None:
    """Every token of every step went to the same experts in every layer as in the reference (compared as multisets
    over all ranks, which hold the tokens in layout-dependent order), before any loss is compared: a near-tie could
    flip a route; the reference's smallest top-k margin is in the message."""
    got: Counter = Counter()
    for r in results:
        got.update((step, layer, tuple(row)) for step, layer, routes in r["routes"] for row in routes.tolist())
    want = reference_routes(ref)
    assert got == want, f"routes differ in {sum(((got - want) + (want - got)).values())} token-layer choices " \
        f"(smallest top-k margin of the reference {ref['margin']:.3g})"
