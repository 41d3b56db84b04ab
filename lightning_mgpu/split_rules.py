"""The rules of how a model and its sequences split over a layout: pipeline stages against layers and tied
embeddings, a sequence over context and sequence-parallel ranks, document masks under context parallelism. Each is
stated once here and asked by the layout (``lightning_mgpu.layout``), the stage split, the attention kernel, the
command line's validation and the planner's search."""

from __future__ import annotations

import math
from typing import Optional

from lightning_mgpu.problems import Problem


def _near(options: list[int], value: int) -> str:
    best = sorted(options, key=lambda o: (abs(o - value), o))[:3]
    return ", ".join(str(o) for o in sorted(best)) or "1"


#: ``model_type`` of the ``transformers`` mixtures of experts whose experts expert parallelism splits
#: (``lightning_mgpu.hf.expert_parallel``); any other is refused ``expert_parallel_size > 1``.
HF_EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def expert_problems(expert_parallel_size: int, data_context_ranks: Optional[int], num_experts: Optional[int],
                    tensor_parallel_size: int = 1, expert_hidden: Optional[int] = None,
                    experts_split: bool = True) -> list[Problem]:
    """The rules of expert parallelism, which folds over the data x context ranks of a replica
    (``data_context_ranks``, None while unknown): each expert lives on one rank of its expert-parallel group, so the
    group's size divides both those ranks and the experts (``num_experts``, None while the model is unknown, 0 for a
    dense model); the tensor-parallel ranks split each expert's hidden width (``expert_hidden``; 0 for experts kept
    whole on every tensor-parallel rank, a ``transformers`` model's). A model whose experts the package does not split
    (``experts_split=False``: a ``transformers`` mixture of experts outside :data:`HF_EXPERT_FAMILIES`) is refused any
    size above 1, since every rank would still hold every expert and the setting would be silently ignored."""
    Ep = expert_parallel_size
    if not isinstance(Ep, int) or Ep < 1:
        return [Problem("expert_parallel_size", Ep, "must be a positive integer", "use 1 to disable expert parallelism")]
    out: list[Problem] = []
    if Ep > 1 and num_experts == 0:
        out.append(Problem("expert_parallel_size", Ep, "needs a mixture-of-experts model (num_experts=0)",
                           "set model.num_experts or expert_parallel_size=1"))
    if Ep > 1 and num_experts and not experts_split:
        return out + [Problem("expert_parallel_size", Ep, f"cannot split the {num_experts} experts of this "
                              "transformers mixture of experts (each rank would still hold every expert): expert "
                              f"parallelism splits those of {', '.join(HF_EXPERT_FAMILIES)} models only",
                              "use expert_parallel_size=1 (ZeRO-3 shards the experts' weights over the data-parallel "
                              "ranks), or the package's own MoE model (model.num_experts), which expert parallelism "
                              "splits")]
    if data_context_ranks is not None and data_context_ranks % Ep:
        fits = [d for d in range(1, data_context_ranks + 1) if data_context_ranks % d == 0
                and (not num_experts or num_experts % d == 0)]
        out.append(Problem("expert_parallel_size", Ep, f"does not divide the {data_context_ranks} data x context ranks "
                           "it folds over", f"choose {_near(fits, Ep)}, or change the number of devices"))
    if num_experts and num_experts % Ep:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0
                and (data_context_ranks is None or data_context_ranks % d == 0)]
        out.append(Problem("expert_parallel_size", Ep, f"does not divide num_experts={num_experts} (each rank of "
                           "the group holds the same number of whole experts)", f"choose {_near(fits, Ep)}"))
    if num_experts and expert_hidden and expert_hidden % tensor_parallel_size:
        out.append(Problem("tensor_parallel_size", tensor_parallel_size, f"does not divide expert_hidden="
                           f"{expert_hidden} (each rank holds a slice of every expert's hidden width)",
                           "choose a tensor_parallel_size that divides it"))
    return out


def stage_count_problems(stages: int, n_layers: int) -> list[Problem]:
    """The rule: every pipeline stage (``pipeline_parallel_size x virtual_pipeline_size`` of them) holds a layer."""
    if stages > n_layers:
        return [Problem("pipeline_parallel_size*virtual_pipeline_size", stages,
                        f"stages is more than the model's n_layers={n_layers}",
                        f"every stage needs at least one layer, so use at most {n_layers}")]
    return []


def qk_norm_problems(tensor_parallel_size: int, qk_norm: bool) -> list[Problem]:
    """The rule: per-head query/key norms (Qwen3) are not split by tensor parallelism: every rank would hold the same
    norm weights but see only its own heads, so their gradients would need a sum over the tensor-parallel ranks,
    which is not built."""
    if qk_norm and tensor_parallel_size > 1:
        return [Problem("tensor_parallel_size", tensor_parallel_size, "cannot split a model with qk_norm=True (the "
                        "q_norm/k_norm weights' gradients would need a sum over the tensor-parallel ranks, which is "
                        "not built)", "set tensor_parallel_size=1 and split the model by pipeline, expert or data "
                        "parallelism instead")]
    return []


def context_model_problems(context_parallel_size: int, pipeline_parallel_size: int, sliding_window: int,
                           context_with_pipeline: bool) -> list[Problem]:
    """The rules a model's attention sets on context parallelism: a window (Mistral's ``sliding_window``) is not
    masked by the context-parallel kernel, and a model whose stages do not cut the sequence into chunks
    (``context_with_pipeline=False``: a ``transformers`` model's) cannot be both context- and pipeline-parallel."""
    C, out = context_parallel_size, []
    if C > 1 and sliding_window:
        out.append(Problem("context_parallel_size", C, f"cannot split a model that attends within a sliding window "
                           f"(sliding_window={sliding_window}): the context-parallel kernel does not mask one",
                           "use context_parallel_size=1 for this model"))
    if C > 1 and pipeline_parallel_size > 1 and not context_with_pipeline:
        out.append(Problem("context_parallel_size", C, f"with pipeline_parallel_size={pipeline_parallel_size}: a "
                           "transformers model's pipeline stages do not cut the sequence into chunks yet",
                           "use one of them"))
    return out


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


#: How replicas synchronise: "sync" (every step, gradients over every data-parallel rank), "local" (each replica
#: steps alone; every ``sync_every`` steps an outer step over the replicas' averaged change in weights) or "async"
#: (each replica pushes its change when its round ends and continues from the newest global weights, waiting for
#: nobody unless it is more than ``max_staleness`` rounds ahead of them).
REPLICA_UPDATES = ("sync", "local", "async")


def timer_problems(update: object, max_time: object) -> list[Problem]:
    """Lightning's ``max_time`` broadcasts its verdict over every rank after every batch: replicas that step apart
    would meet (and wait for the slowest) at every inner step."""
    if steps_apart(update) and max_time is not None:
        return [Problem("max_time", max_time, f"makes every rank meet after every batch (Lightning broadcasts whether "
                        f"time is up), which replica_update={update!r} exists to avoid",
                        "stop by max_steps, or use replica_update='sync'")]
    return []


def copies_inside(tensor_parallel: int, context_parallel: int, data_per_replica: int, zero_stage: int) -> int:
    """The most ranks of one replica that hold a copy of the same master weight: the tensor-parallel ranks (each
    keeps the replicated norms), or without tensor parallelism under ZeRO-0 every data and context rank."""
    if tensor_parallel > 1:
        return tensor_parallel
    return context_parallel * data_per_replica if zero_stage == 0 else 1


def steps_apart(update: object) -> bool:
    """Whether replicas take their optimizer steps apart (an outer step over their weights joins them), the rule
    every check of the outer step's needs asks."""
    return update in ("local", "async")


def replica_problems(data_ranks: Optional[int], replicas: int, update: object, sync_every: object,
                     offloaded: bool = False, max_staleness: object = 0, copies_inside: int = 1) -> list[Problem]:
    """Replicas divide the ``data_ranks`` (tp x cp x pp copies of the model; None while that is not whole), are only
    separate when they step apart (``local``, ``async``), and synchronise every ``sync_every >= 1`` steps; the outer
    step acts on the fp32 master weights in memory, which ZeRO offload (``offloaded``) moves away; ``async`` needs
    two replicas or more, and its staleness bound ``max_staleness`` counts rounds (>= 0); above 0, no two ranks of a
    replica may hold a copy of the same master weight (``copies_inside``: the most that do), since each pulls its
    slices on its own."""
    out = []
    if steps_apart(update) and offloaded:
        out.append(Problem("replica_update", update, "cannot run with ZeRO offload (the outer step updates the fp32 "
                           "master weights where the engine keeps them; offloaded, they are on the host or on NVMe)",
                           "set offload_optimizer=None and offload_params=None, or replica_update='sync'"))
    if update not in REPLICA_UPDATES:
        out.append(Problem("replica_update", update, "is unknown", f"choose one of {', '.join(REPLICA_UPDATES)}"))
    if update == "async" and replicas == 1:
        out.append(Problem("replica_update", "async", "needs more than one replica to be asynchronous with",
                           "set replicas to 2 or more, or replica_update='sync'"))
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        out.append(Problem("max_staleness", max_staleness, "must be an integer >= 0 (rounds a replica may run ahead "
                           "of the newest global weights; 0 waits for every replica each round)", "use 0 to 4"))
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        out.append(Problem("sync_every", sync_every, "must be a positive integer (inner steps per outer step)",
                           "use 1 or more"))
    if replicas > 1 and update == "sync":
        out.append(Problem("replicas", replicas, "splits the data-parallel ranks into groups that synchronise on "
                           "their own, which replica_update='sync' does not do", "set replica_update='local' (or "
                           "'async') or replicas=1"))
    if update == "async" and isinstance(max_staleness, int) and max_staleness > 0 and copies_inside > 1:
        out.append(Problem("max_staleness", max_staleness, "lets the ranks of one replica continue from different "
                           "versions of the global weights (each pulls its own slices), so the copies of a parameter "
                           f"that {copies_inside} of its ranks hold (tensor-parallel ranks' replicated norms, ZeRO-0 data "
                           "ranks' whole weights) would drift apart", "use max_staleness=0 with tensor parallelism or "
                           "ZeRO-0, or ZeRO >= 1 without tensor parallelism"))
    if data_ranks is not None and data_ranks % replicas:
        valid = [r for r in range(1, data_ranks + 1) if data_ranks % r == 0]
        out.append(Problem("replicas", replicas, f"does not divide the {data_ranks} data-parallel ranks",
                           f"choose {', '.join(map(str, valid))}"))
    return out
