"""The model's own load-balancing loss (``output_router_logits=True``, ``router_aux_loss_coef``) under a layout."""

from __future__ import annotations

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.problems import Problem


def router_loss_problems(found: HFModel, layout: ParallelLayout) -> list[Problem]:
    """The model's load-balancing loss (``output_router_logits=True``) is added by its causal LM's ``forward`` from
    every layer's router logits over the tokens that call saw. Pipeline stages run the layers and the head, not that
    ``forward``, so the loss would be left out; under context or sequence parallelism each rank sees a part of each
    sequence, so its statistics would count that part only (the ranks' losses then differ from one process's and, under
    sequence parallelism, from each other). Refused, every such axis at once."""
    if not getattr(found.config, "output_router_logits", False):
        return []
    name, out = type(found.model).__name__, []
    fix = "set the model's config.output_router_logits=False (no load-balancing loss), or "
    if layout.size("pp") > 1:
        out.append(Problem("pipeline_parallel_size", layout.size("pp"), f"with output_router_logits=True: {name} adds "
                           "its load-balancing loss in its forward from every layer's router logits, which pipeline "
                           "stages do not run, so the loss would be left out", fix + "pipeline_parallel_size=1"))
    for key, on, value in (("context_parallel_size", layout.size("cp") > 1, layout.size("cp")),
                           ("sequence_parallel", layout.sequence_parallel, True)):
        if on:
            out.append(Problem(key, value, f"with output_router_logits=True: {name}'s load-balancing loss would count "
                               "each rank's part of the sequence only, not the whole sequence as one process does",
                               fix + f"{key}={'1' if key.endswith('size') else 'False'}"))
    return out
