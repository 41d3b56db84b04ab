"""Tensor-parallel plans: data that maps module names to styles, and the one function that applies them.

A plan is a mapping ``{module name pattern: style}``; ``*`` in a pattern matches one name component
(``"layers.*.attention.wq"``). Applying it swaps each matched module, in place, for its tensor-parallel
counterpart holding this rank's shard of the weights the module already had.

Styles (see :mod:`lightning_mgpu.parallel.tensor` for where each puts its collectives):

===================  ==========================================================================
``norm``             a norm whose output feeds column-parallel layers: enters the region
``colwise``          ``nn.Linear`` split by output features, fed directly by a ``norm``
``colwise_enter``    the same, fed by anything else: enters the region itself
``rowwise``          ``nn.Linear`` split by input features; sums the partial products
``colwise_gather``   ``colwise`` whose output is gathered whole on every rank (what follows runs whole)
``rowwise_split``    ``rowwise`` whose input is whole on every rank: each takes its chunk first
``vocab_embedding``  ``nn.Embedding`` split by vocabulary rows
``vocab_output``     the LM head ``nn.Linear``, logits left sharded over the vocabulary (use
                     :func:`lightning_mgpu.parallel.cross_entropy.cross_entropy`), fed by a ``norm``
``vocab_output_enter``  the same, fed by anything else with the whole sequence on every rank: enters the region
                     itself (also under sequence parallelism, whose shards a ``sequence_gather`` joined before)
``vocab_embedding_allreduce``  ``vocab_embedding`` whose output is the whole sequence on every rank even under
                     sequence parallelism (a model that reads the sequence length off the embeddings)
===================  ==========================================================================

Styles that keep a module as it is and add hooks (``enter_region``, ``sequence_scatter``, ``sequence_gather``,
``grad_sum``, ``grad_sum_sp``) are for models whose code is not ours: :mod:`lightning_mgpu.parallel.plan_hooks`.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Mapping

from torch import nn

from lightning_mgpu.parallel.tensor import (
    ColumnParallelLinear,
    ParallelNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    embedding_output_scale,
    padded_size,
    rank_and_size,
)
from lightning_mgpu.parallel.plan_hooks import HOOK_BUILDERS
from lightning_mgpu.problems import format_problems

TensorParallelPlan = Mapping[str, str]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "norm": lambda m, g, sp: ParallelNorm(m, g, sp),
    "colwise": lambda m, g, sp: ColumnParallelLinear(m, g, sp),
    "colwise_enter": lambda m, g, sp: ColumnParallelLinear(m, g, sp, enters_region=True),
    "rowwise": lambda m, g, sp: RowParallelLinear(m, g, sp),
    "colwise_gather": lambda m, g, sp: ColumnParallelLinear(m, g, sp, gather_output=True),
    "rowwise_split": lambda m, g, sp: RowParallelLinear(m, g, sp, split_input=True),
    "vocab_embedding": lambda m, g, sp: VocabParallelEmbedding(m, g, sp),
    "vocab_output": lambda m, g, sp: VocabParallelOutput(m, g, sp),
    "vocab_output_enter": lambda m, g, sp: VocabParallelOutput(m, g, False, enters_region=True),
    "vocab_embedding_allreduce": lambda m, g, sp: VocabParallelEmbedding(m, g, False),
    **HOOK_BUILDERS,
}
STYLES = tuple(_BUILDERS)


@functools.lru_cache(maxsize=None)
def plan_pattern(key: str) -> re.Pattern:
    """The regular expression of a plan key (`*` matches one name component)."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*")))


def resolve_plan(module: nn.Module, plan: TensorParallelPlan) -> tuple[dict[str, str], list[str]]:
    """(module name -> style for every module the plan matches, problems with the plan itself)."""
    names = [name for name, _ in module.named_modules() if name]
    resolved: dict[str, str] = {}
    problems: list[str] = []
    for key, style in plan.items():
        if style not in _BUILDERS:
            problems.append(f"plan entry {key!r}: style {style!r} is unknown; choose one of {', '.join(STYLES)}")
            continue
        matched = [n for n in names if plan_pattern(key).fullmatch(n)]
        if not matched:
            example = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            problems.append(f"plan entry {key!r} matches no module; names look like: {example}")
        for name in matched:
            if name in resolved and resolved[name] != style:
                problems.append(f"module {name!r} is matched as {resolved[name]!r} and as {style!r}; keep one entry")
            resolved[name] = style
    return resolved, problems


#: Styles that swap a module for a layer of :mod:`lightning_mgpu.parallel.tensor`, by the class they swap.
SWAPPED_CLASS = {"colwise": nn.Linear, "colwise_enter": nn.Linear, "rowwise": nn.Linear, "colwise_gather": nn.Linear,
                 "rowwise_split": nn.Linear, "vocab_output": nn.Linear, "vocab_output_enter": nn.Linear,
                 "vocab_embedding": nn.Embedding, "vocab_embedding_allreduce": nn.Embedding}


def _module_problem(name: str, style: str, m: nn.Module, T: int) -> list[str]:
    base = SWAPPED_CLASS.get(style)
    if base is not None and not isinstance(m, base):
        return [f"{name!r} is a {type(m).__name__}; style {style!r} needs an nn.{base.__name__}"]
    if base is not None and type(m).forward is not base.forward and \
            not (base is nn.Embedding and embedding_output_scale(m) is not None):
        return [f"{name!r} is a {type(m).__name__}, whose own forward would be lost: style {style!r} swaps it for "
                f"a tensor-parallel nn.{base.__name__}; leave it out of the plan (whole on every rank) or make it a "
                f"plain nn.{base.__name__}"]
    if style == "norm":
        params = dict(m.named_parameters(recurse=True))
        weight = params.get("weight")
        if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
            return [f"{name!r} ({type(m).__name__}) cannot use style 'norm': it needs a 1-D 'weight' (and optionally "
                    f"'bias') and no other parameters, computing normalise(x) * weight + bias; it has "
                    f"{sorted(params) or 'no parameters'}"]
        return []
    if style in ("colwise", "colwise_enter", "colwise_gather") and m.out_features % T:
        return [f"tensor_parallel_size={T} does not divide {name}.out_features={m.out_features} (style {style!r} "
                f"splits the output features); choose a tensor_parallel_size that divides it"]
    if style in ("rowwise", "rowwise_split") and m.in_features % T:
        return [f"tensor_parallel_size={T} does not divide {name}.in_features={m.in_features} (style {style!r} "
                f"splits the input features); choose a tensor_parallel_size that divides it"]
    return []


def plan_problems(module: nn.Module, plan: TensorParallelPlan, tensor_parallel_size: int) -> list[str]:
    """Every reason ``plan`` cannot split ``module`` over ``tensor_parallel_size`` ranks (empty when it can)."""
    return _checked(module, plan, tensor_parallel_size)[1]


def _checked(module: nn.Module, plan: TensorParallelPlan, T: int) -> tuple[dict[str, str], list[str]]:
    resolved, problems = resolve_plan(module, plan)
    modules = dict(module.named_modules())
    for name, style in resolved.items():
        problems += _module_problem(name, style, modules[name], T)
    return resolved, problems


def apply_tensor_parallel(module: nn.Module, plan: TensorParallelPlan, group: Any,
                          sequence_parallel: bool = False) -> list[str]:
    """Split ``module`` in place over the ranks of ``group`` as ``plan`` says; return notes worth reporting.

    Every rank must hold the same full weights beforehand (same seed or same checkpoint); each keeps its
    shard. Tied parameters stay tied. Raises one ``ValueError`` listing every problem before changing
    anything.
    """
    T = rank_and_size(group)[1]
    resolved, problems = _checked(module, plan, T)
    if problems:
        raise ValueError(format_problems("Invalid tensor-parallel plan", problems))
    notes: list[str] = []
    shards: dict[int, nn.Parameter] = {}  # id of an original parameter -> its shard, so ties survive
    for name, style in resolved.items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        original = getattr(parent, child)
        originals = {n: p for n, p in original.named_parameters(recurse=False)}
        replacement = _BUILDERS[style](original, group, sequence_parallel)
        for pname, p in originals.items():
            new = replacement._parameters.get(pname)
            if new is None:
                continue
            if id(p) in shards and shards[id(p)].shape == new.shape:
                setattr(replacement, pname, shards[id(p)])
            else:
                shards[id(p)] = new
        setattr(parent, child, replacement)
        if style in ("vocab_embedding", "vocab_output", "vocab_output_enter", "vocab_embedding_allreduce"):
            vocab = replacement.vocab_size
            padded = padded_size(vocab, T)
            if padded != vocab:
                notes.append(f"{name}: vocabulary of {vocab} padded to {padded} rows, a multiple of "
                             f"tensor_parallel_size={T} ({padded - vocab} unused rows, never predicted)")
    return notes
