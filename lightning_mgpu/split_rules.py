"""The rules of how a model and its sequences split over a layout: pipeline stages against layers and tied
embeddings, a sequence over context and sequence-parallel ranks, document masks under context parallelism. Each is
stated once here and asked by the layout (``lightning_mgpu.layout``), the stage split, the attention kernel, the
command line's validation and the planner's search."""

from __future__ import annotations

import math

from lightning_mgpu.problems import Problem


def context_document_problems(context_parallel_size: int, document_mask: bool) -> list[Problem]:
    """The rule: context parallelism does not mask documents yet (each rank would need the document boundaries of
    the chunks it does not hold)."""
    if context_parallel_size > 1 and document_mask:
        return [Problem("context_parallel_size", context_parallel_size, "does not support document masking yet (each "
                        "rank would need the document boundaries of the chunks it does not hold)",
                        "set document_mask=False (the model's eod_token_id=None) or context_parallel_size=1")]
    return []


def stage_count_problems(stages: int, n_layers: int) -> list[Problem]:
    """The rule: every pipeline stage (``pipeline_parallel_size x virtual_pipeline_size`` of them) holds a layer."""
    if stages > n_layers:
        return [Problem("pipeline_parallel_size*virtual_pipeline_size", stages,
                        f"stages is more than the model's n_layers={n_layers}",
                        f"every stage needs at least one layer, so use at most {n_layers}")]
    return []


def tied_embedding_problems(pipeline_parallel_size: int, tie_embeddings: bool) -> list[Problem]:
    """The rule: a model whose output head shares the embedding's weight cannot be split into pipeline stages (the
    embedding lives on the first stage, the head on the last)."""
    if pipeline_parallel_size > 1 and tie_embeddings:
        return [Problem("tie_embeddings", True, "cannot be split into pipeline stages (the embedding lives on the "
                        "first stage, the head on the last)", "set tie_embeddings=False or pipeline_parallel_size=1")]
    return []


def sequence_problems(seq_len: int, context_parallel_size: int = 1, tensor_parallel_size: int = 1,
                      sequence_parallel: bool = False, key: str = "seq_len") -> list[str]:
    """The one rule for how a sequence of ``seq_len`` tokens splits: context parallelism gives each of its ``C`` ranks
    two equal chunks (an early and a late one, which balances causal attention), so ``seq_len`` must be a multiple of
    ``2 * C``; sequence parallelism then splits each rank's ``seq_len / C`` tokens ``T`` ways, so also of ``C * T``."""
    C, T = context_parallel_size, tensor_parallel_size if sequence_parallel else 1
    unit = math.lcm(2 * C if C > 1 else 1, C * T)
    if unit == 1 or seq_len % unit == 0:
        return []
    why = []
    if C > 1:
        why.append(f"context_parallel_size={C} gives each rank 2 of {2 * C} equal chunks")
    if T > 1:
        why.append(f"sequence parallelism splits each rank's tokens over tensor_parallel_size={T}")
    lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
    near = f"{lower} or {upper}" if lower else f"{upper}"
    return [f"{key}={seq_len} is not a multiple of {unit} ({'; '.join(why)}); use {near}"]
