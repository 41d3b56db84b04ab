"""What Lightning prints at the start of a fit and during it, with the figures of a split model.

Lightning's model summary counts the parameters of the modules in this process: under tensor parallelism that is a
shard, under a pipeline one stage, under ZeRO-3 nothing at all (its partitions have no shape); its FLOPs column reads 0
unless the module sets ``example_input_array``, which a split model cannot run alone. Its rich progress bar writes
``Epoch 0/-2`` when the fit is bounded by ``max_steps`` with ``max_epochs=-1``. :func:`use_layout_console` swaps
Lightning's own two (never a subclass a user chose) for the ones below; any other strategy keeps Lightning's.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.model_summary.model_summary_deepspeed import DeepSpeedSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override


class LayoutModelSummary(ModelSummary):
    """Lightning's per-module table of this rank (without the FLOPs column), then the whole model's parameters,
    counted over its shards and stages (``trainer.strategy.parameter_counts``), and what this rank holds."""

    def __init__(self, max_depth: int = 1, rich: bool = False) -> None:
        super().__init__(max_depth=max_depth)
        self.rich = rich

    @override
    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """Lightning's summary of this rank's modules; ZeRO-3's partitioned parameters by their whole size."""
        if any(hasattr(p, "ds_numel") for p in pl_module.parameters()):
            return DeepSpeedSummary(pl_module, max_depth=self._max_depth)
        return super()._summary(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = getattr(trainer.strategy, "parameter_counts", None)
        if counts is None or not self._max_depth:
            return super().on_fit_start(trainer, pl_module)
        summary = self._summary(trainer, pl_module)
        split = counts.on_rank != counts.total
        columns = [("Params on this rank" if split and name == "Params" else name, values)
                   for name, values in summary._get_summary_data() if name != "FLOPs"]
        if not trainer.is_global_zero:
            return
        lines = [f"Trainable params: {get_human_readable_count(counts.trainable)}",
                 f"Non-trainable params: {get_human_readable_count(counts.total - counts.trainable)}",
                 f"Total params: {get_human_readable_count(counts.total)}"]
        if split:
            lines.append(f"Params on rank 0: {get_human_readable_count(counts.on_rank)} (its shards and stages of the "
                         "model, before ZeRO partitions them)")
        modes = summary.total_training_modes
        lines.append(f"Modules in train mode: {modes['train']}; in eval mode: {modes['eval']}")
        _print_table(columns, lines, self.rich)


def _print_table(columns: list[tuple[str, list[str]]], lines: list[str], rich: bool) -> None:
    """``columns`` as a table (rich, as Lightning's RichModelSummary draws it, or plain text), then ``lines``."""
    rows = list(zip(*(values for _name, values in columns)))
    if rich:
        from rich import get_console
        from rich.table import Table

        table = Table(header_style="bold magenta")
        for name, _values in columns:
            table.add_column(name, justify="right" if name.startswith("Params") else "left")
        for row in rows:
            table.add_row(*row)
        get_console().print(table)
        get_console().print("\n".join(lines))
        return
    widths = [max(len(name), *(len(v) for v in values)) for name, values in columns]
    text = [" | ".join(name.ljust(w) for (name, _v), w in zip(columns, widths))]
    text.append("-" * len(text[0]))
    text += [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    rank_zero_info("\n".join(text + ["-" * len(text[0]), *lines]))


class StepBoundedProgressBar(RichProgressBar):
    """Lightning's rich progress bar, without the bound ``Epoch 0/-2`` that a fit bounded by steps shows
    (``max_epochs=-1``: endless epochs)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"


def use_layout_console(trainer: L.Trainer, stage: str) -> None:
    """Replace the trainer's Lightning ``ModelSummary``/``RichModelSummary`` and ``RichProgressBar`` (exactly those
    classes, as Lightning adds them by default) by the ones above, keeping their settings; called from the strategy's
    ``setup``, after Lightning ran the callbacks' ``setup``, which the replacements are given here."""
    swapped: list[Any] = []
    for callback in trainer.callbacks:
        kind = type(callback)
        if kind in (ModelSummary, RichModelSummary):
            callback = LayoutModelSummary(callback._max_depth, rich=kind is RichModelSummary)
        elif kind is RichProgressBar:
            callback = StepBoundedProgressBar(callback._refresh_rate, callback._leave, callback.theme,
                                              callback._console_kwargs)
            callback.setup(trainer, trainer.lightning_module, stage)
        swapped.append(callback)
    trainer.callbacks = swapped
