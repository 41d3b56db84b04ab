"""``metrics.csv`` across restarts: a restarted or resumed run keeps the rows of the steps before its checkpoint.

Lightning's ``CSVLogger`` deletes the ``metrics.csv`` it finds in its directory, so after a restart (torch elastic,
torchrun, a SLURM requeue with ``checkpoint.resume=auto``) the run directory held only the last attempt's steps.
Here the file is kept when the writer starts, and at the start of training, once the checkpoint has been restored,
the rows of the steps at and after the restored step are dropped: the attempt trains those steps again and logs
them itself. A run that starts from step 0 in a directory that held a run drops every old row, as Lightning does.
"""

from __future__ import annotations

import csv
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override


class _KeptMetricsWriter(ExperimentWriter):
    """Lightning's writer without the deletion: the header of a kept file becomes the writer's keys, so that new rows
    with other keys rewrite the file with every column."""

    @override
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = sorted(csv.DictReader(file).fieldnames or [])

    def keep_steps_before(self, step: int) -> int:
        """Drop the rows of ``step`` and after from the kept file; the number of rows kept."""
        if not self._fs.isfile(self.metrics_file_path):
            return 0
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            rows = [row for row in csv.DictReader(file) if int(row["step"]) < step]
        with self._fs.open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)
        return len(rows)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` keeps the steps before the checkpoint a run resumed from (with
    :class:`KeepMetricsBeforeResume` among the callbacks)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _KeptMetricsWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeptMetricsWriter(log_dir=self.log_dir)
        return self._experiment


class KeepMetricsBeforeResume(L.Callback):
    """At the start of training, after the checkpoint is restored: each :class:`ResumableCSVLogger` drops the rows of
    the steps this run trains again."""

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, ResumableCSVLogger):
                logger.experiment.keep_steps_before(trainer.global_step)
