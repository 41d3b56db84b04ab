"""What a mixture-of-experts run logs about its routing, every training batch: per layer the load of its last
micro-batch on this rank (the busiest expert's tokens over the mean), the fraction of assignments dropped by a
capacity limit, the balancing losses and the spread of the balancing bias. The logger writes rank 0's: under pipeline
parallelism the layers of the first stage only. ``LLMModule`` adds this callback to every Trainer it runs in when its
model has experts."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_mgpu.models.moe import MoEFeedForward
from lightning_mgpu.parallel.experts import move_router_biases


def layer_report(layer: MoEFeedForward) -> dict[str, float]:
    """One layer's last routing, as numbers to log."""
    stats = layer.stats
    counts = stats["counts"].float()
    bias = layer.router.expert_bias
    return {"load": float(counts.max() / counts.mean().clamp_min(1e-9)), "dropped": float(stats["dropped"]),
            "aux_loss": float(stats["aux_loss"]), "z_loss": float(stats["z_loss"]),
            "bias_spread": float(bias.max() - bias.min())}


class ExpertLoad(L.Callback):
    """Logs ``moe/<layer>/<what>`` for every mixture-of-experts layer on this rank, and ``moe/<what>`` (the mean over
    them; the largest for the load)."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        model = trainer.strategy.model if trainer.strategy.model is not None else module
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward) and m.stats]
        if not layers:
            return
        reports = {name.split("layers.")[-1].split(".")[0]: layer_report(m) for name, m in layers}
        metrics = {f"moe/layers.{i}/{k}": v for i, report in reports.items() for k, v in report.items()}
        for key in ("dropped", "aux_loss", "z_loss", "bias_spread"):
            metrics[f"moe/{key}"] = sum(r[key] for r in reports.values()) / len(reports)
        metrics["moe/load"] = max(r["load"] for r in reports.values())
        module.log_dict({k: torch.tensor(v) for k, v in metrics.items()}, rank_zero_only=True, on_step=True)
        if getattr(module, "parallel_context", None) is None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            balance_without_strategy([m for _, m in layers])


def balance_without_strategy(layers: list[MoEFeedForward]) -> None:
    """Under a strategy that is not ``MGPUStrategy`` (one device, DDP): the balancing bias moves by the step's counts
    summed over every process (MGPUStrategy does this itself after each engine step)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    move_router_biases(layers, dist.group.WORLD if distributed else None)
