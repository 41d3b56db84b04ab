"""Validation, test and predict hooks of the strategy. Without pipeline parallelism they are Lightning's own (the
engine's forward); with it, the module's ``validation_step``/``test_step`` run directly, under the precision plugin's
context, and their ``loss()`` runs the pipeline forward-only on every rank. A rank that fails or stops answering
during validation is named (``name_lost_ranks``), as during training."""

from __future__ import annotations

from typing import Any

from lightning_mgpu.resilience.liveness import name_lost_ranks


class EvaluationSteps:
    """``validation_step``, ``test_step`` and ``predict_step`` for a strategy with ``pipeline``, ``_heartbeat``,
    ``precision_plugin`` and ``lightning_module``."""

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with name_lost_ranks(self._heartbeat):
            if self.pipeline is None:
                return super().validation_step(*args, **kwargs)
            with self.precision_plugin.val_step_context():
                return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise NotImplementedError("predict is not supported with pipeline parallelism (pipeline_parallel_size > 1): "
                                      "a prediction needs outputs of the last stage on every rank; use validation "
                                      "or pipeline_parallel_size=1")
        return super().predict_step(*args, **kwargs)
