"""The parallel hooks of :class:`lightning_mgpu.contract.ParallelModule`, given for a LightningModule that holds a
``transformers`` causal LM and defines none of them: the user writes no plan, no stages and no loss.

``MGPUStrategy`` attaches them (:func:`adopt`) before it checks and splits the module; a hook the module defines itself
is used instead of the one here. Tensor parallelism keeps the user's ``training_step`` (``model(..., labels=...)
.loss``): the model's loss becomes the vocabulary-parallel one. Pipeline parallelism runs the model's own loss on the
last stage over a batch of token ids (bare, in a list or tuple with optional labels, or a collator's mapping with
``input_ids`` and optionally ``labels``, ``attention_mask`` and ``position_ids``, which travel with the hidden states);
a validation step calling the model with ``labels=`` gets the pipeline's loss.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_mgpu.contract import ADAPTER_ATTRIBUTE, parallel_context
from lightning_mgpu.hf.adapters import (adapter_plan, adapter_record, prompt_learning_problems,
                                         quantized_base_problems, unwrapped)
from lightning_mgpu.hf.context import apply_context_parallel
from lightning_mgpu.hf.expert_parallel import apply_hf_expert_parallel
from lightning_mgpu.hf.loss import causal_lm_loss
from lightning_mgpu.hf.model import HFModel, find_hf_model
from lightning_mgpu.hf.router_loss import last_stage_loss, wire_router_loss
from lightning_mgpu.hf.stages import HFStage, hf_stages
from lightning_mgpu.hf.tensor_plan import hf_tp_plan
from lightning_mgpu.layout import ModelShape, ParallelLayout
from lightning_mgpu.parallel.pipeline import stage_container
from lightning_mgpu.parallel.plan_hooks import sequence_gather, sequence_scatter
from lightning_mgpu.parallel.token_batch import read_batch
from lightning_mgpu.problems import format_problems, raise_problems

#: Arguments of a model call that the pipeline's forward-only loss may pass over (the labels carry the same targets).
PASSED_OVER = ("shift_labels", "use_cache", "return_dict", "num_items_in_batch")


class HFHooks:
    """The hooks for ``found`` inside ``owner`` (the LightningModule) on ``layout``."""

    def __init__(self, found: HFModel, owner: nn.Module, layout: ParallelLayout) -> None:
        self.found, self.owner, self.layout = found, owner, layout

    @property
    def model_shape(self) -> ModelShape:
        return self.found.shape()

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The model's own plan, translated (PEFT's adapters following their base layers' split); its ``labels=`` loss
        becomes the vocabulary-parallel one."""
        plan, problems = adapter_plan(self.owner, hf_tp_plan(self.found))
        if problems:
            raise ValueError(format_problems("Cannot split PEFT's adapters over tensor-parallel ranks", problems))
        model = self.found.model
        model.loss_function = causal_lm_loss(lambda: unwrapped(model.get_output_embeddings()))
        return plan

    def checkpoint_record(self) -> dict[str, Any]:
        """The adapters' configuration and base, when the model is wrapped by PEFT (:func:`adapter_record`)."""
        return adapter_record(self.owner)

    def context_parallel_attention(self, group: Any, rank: int, size: int) -> int:
        """Wires the model's attention for ``size`` context ranks; what its shape forbids (a window, pipeline stages)
        was refused with the layout (``model_shape``)."""
        return apply_context_parallel(self.found, group, rank, size)

    def expert_parallel(self, layout: ParallelLayout) -> list[str]:
        """Splits the model's routed experts over the expert-parallel ranks (:mod:`lightning_mgpu.hf.expert_parallel`)
        and forms its load-balancing loss over the tokens and stages the layout splits
        (:mod:`lightning_mgpu.hf.router_loss`)."""
        notes = apply_hf_expert_parallel(self.found, layout)
        wire_router_loss(self.found, layout)
        return notes

    def pipeline_stages(self, stage_ids: list[int], num_stages: int,
                        boundaries: Optional[list[int]] = None) -> nn.ModuleDict:
        stages = hf_stages(self.found, stage_ids, num_stages, boundaries)
        if self.layout.sequence_parallel:
            self._cut_sequence_at_stage_ends(stages.values())
        self.found.model.forward = self._pipelined_forward
        container = stage_container(stages)
        container.canonical_prefix = self.found.prefix  # checkpoints name parameters as without stages
        return container

    def _cut_sequence_at_stage_ends(self, stages: Sequence[HFStage]) -> None:
        """Hidden states travel between stages whole: each stage scatters them in and gathers them out."""
        group = self.layout.group("tp")
        for stage in stages:
            layers = list(getattr(getattr(stage, stage.base_name), stage.layers_name))
            if not stage.first:  # the first layer of the whole model scatters by the plan already
                sequence_scatter(layers[0], group, True)
            sequence_gather(layers[-1], group, True)

    def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """(the first stage's input, labels) of a batch as the loader yields it (:func:`read_batch`: a tensor of token
        ids, a list or tuple (ids[, labels]), or a collator's mapping with ``input_ids`` and optionally ``labels``,
        ``attention_mask``, ``position_ids``); the ids are their own labels where none are given (the model shifts
        them). A mask or positions make the input ``(ids, positions[, mask])``, which the stages hand on
        (:class:`HFStage`); positions default to the model's own, ``0 ... seq - 1``."""
        read = read_batch(batch)
        labels = read.ids if read.labels is None else read.labels
        if read.attention_mask is None and read.position_ids is None:
            return read.ids, labels
        positions = read.position_ids
        if positions is None:
            positions = torch.arange(read.ids.shape[1], device=read.ids.device).expand_as(read.ids).contiguous()
        extra = () if read.attention_mask is None else (read.attention_mask,)
        return (read.ids, positions, *extra), labels

    def pipeline_loss(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM loss of one micro-batch on the last stage (and its load-balancing loss, where the
        stage formed one: :func:`last_stage_loss`)."""
        model = self.found.model
        return last_stage_loss(model, logits, lambda out: model.loss_function(logits=out, labels=labels,
                                                                               vocab_size=self.found.config.vocab_size))

    def _pipelined_forward(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                           attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                           **ignored: Any) -> Any:
        """The model's ``forward`` once its stages are spread over ranks: the pipeline's forward-only loss (every
        rank gets it), for a validation or test step that calls ``model(input_ids=..., labels=...)``."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        context = parallel_context(self.owner)
        unused = sorted(key for key, value in ignored.items() if value is not None and key not in PASSED_OVER)
        if context is None or context.pipeline is None or input_ids is None or unused:
            raise RuntimeError(f"this model's layers are spread over pipeline stages: call it as model(input_ids=..., "
                               f"labels=..., attention_mask=..., position_ids=...) inside a validation or test step of "
                               f"the run (got {unused or 'no input_ids'}; nothing else travels between stages)")
        given = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
                 "position_ids": position_ids}
        return CausalLMOutputWithPast(loss=context.pipeline.evaluate(
            *self.pipeline_batch({key: value for key, value in given.items() if value is not None})))


def adopt(module: nn.Module, layout: ParallelLayout) -> Optional[HFHooks]:
    """Attach the hooks for the ``transformers`` model ``module`` holds (none when it holds none)."""
    found = find_hf_model(module)
    if found is None:
        return None
    where = f"{type(module).__name__}.{found.prefix}".rstrip(".")
    sizes = {"tp": layout.tensor_parallel_size, "pp": layout.pipeline_parallel_size, "cp": layout.context_parallel_size}
    raise_problems("Unsupported model", quantized_base_problems(found.model, where)
                   + prompt_learning_problems(module, sizes, where))
    hooks = HFHooks(found, module, layout)
    object.__setattr__(module, ADAPTER_ATTRIBUTE, hooks)
    return hooks
