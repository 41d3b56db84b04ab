"""The one validated object that owns the parallel layout: what a run asks of it (:class:`LayoutRequest`), its
rules, and (through :class:`~lightning_mgpu.rank_grid.RankGrid`) rank coordinates and process groups."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from lightning_mgpu.problems import Problem, format_problems
from lightning_mgpu.rank_grid import RankGrid
from lightning_mgpu.split_rules import (context_model_problems, copies_inside, expert_problems, qk_norm_problems,
                                       replica_problems, stage_count_problems, tied_embedding_problems)


#: Pipeline schedules by their public name (see ``torch.distributed.pipelining.schedules``).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
#: Schedules that run several stage chunks per rank and so need ``virtual_pipeline_size > 1``.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
#: Schedules that hold exactly two chunks per rank in a V shape.
V_SCHEDULES = ("zbv", "dualpipev")
#: Schedules that write weight gradients outside autograd's normal backward, which ZeRO-3 cannot follow.
ZERO3_INCOMPATIBLE_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")
OFFLOAD_DEVICES = (None, "cpu", "nvme")


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model that constrain how it may be split."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 0
    expert_hidden: int = 0
    qk_norm: bool = False
    #: Attention within a window of this many tokens (0: none); refuses context parallelism.
    sliding_window: int = 0
    #: Whether the model's pipeline stages can take context-parallel chunks (a ``transformers`` model's cannot).
    context_with_pipeline: bool = True
    #: Whether expert parallelism can split the model's experts (a ``transformers`` mixture of experts' outside
    #: ``split_rules.HF_EXPERT_FAMILIES`` cannot).
    experts_split: bool = True

    @classmethod
    def of(cls, config) -> "ModelShape":
        """The shape of a model config with these fields (e.g. ``LlamaConfig``). q/k norms that a model keeps whole
        on every tensor-parallel rank (``qk_norm_whole``: a ``transformers`` model's) constrain no split."""
        qk_norm = bool(getattr(config, "qk_norm", False)) and not getattr(config, "qk_norm_whole", False)
        return cls(config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_hidden, config.vocab_size,
                   bool(getattr(config, "tie_embeddings", False)), int(getattr(config, "num_experts", 0)),
                   int(getattr(config, "expert_ffn_hidden", 0)), qk_norm, int(getattr(config, "sliding_window", 0)),
                   bool(getattr(config, "context_with_pipeline", True)), bool(getattr(config, "experts_split", True)))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(options: list[int]) -> str:
    if not options:
        return "none"
    if len(options) == 1:
        return str(options[0])
    return ", ".join(str(o) for o in options[:-1]) + f" or {options[-1]}"


@dataclass(frozen=True)
class LayoutRequest:
    """What a run asks of its layout before the world size, the model and the data are known: the strategy's
    arguments (``MGPUStrategy(...)``, ``parallel.*`` in Hydra). :meth:`problems_with` checks it against what is known so
    far; :meth:`build` builds the one :class:`ParallelLayout` of a process once its world exists."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    zero_stage: int = 0
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    num_microbatches: Optional[int] = None
    sequence_parallel: bool = False
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None
    replicas: int = 1  #: groups of data-parallel ranks that synchronise by ``replica_update`` (outermost axis)
    replica_update: str = "sync"  #: "sync" (every step, over every data-parallel rank) | "local" | "async"
    sync_every: int = 1  #: inner steps between the replicas' outer steps (``local``, ``async``)
    max_staleness: int = 2  #: ``async``: rounds a replica may run ahead of the newest global weights
    expert_parallel_size: int = 1  #: ranks of the data x context ranks that split the experts of each layer

    def smallest_world(self) -> int:
        """The world size of one model copy in each replica (1 while a size is invalid: :meth:`problems` names it)."""
        sizes = (self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size, self.replicas,
                 self.expert_parallel_size)
        if not all(isinstance(n, int) and n > 0 for n in sizes):
            return 1
        T, P, C, R, Ep = sizes
        return T * P * math.lcm(C, Ep) * R  # experts fold over the data x context ranks: enough of them for Ep

    def problems_with(self, world_size: Optional[int] = None, model: Optional[ModelShape] = None,
                      **known: object) -> list[Problem]:
        """Every rule the request breaks with the world (default: one replica), model and micro-batches known."""
        return layout_problems(**self._arguments(world_size or self.smallest_world(), model, known))

    def build(self, world_size: int, devices_per_node: Optional[int] = None, model: Optional[ModelShape] = None,
              **known: object) -> "ParallelLayout":
        return ParallelLayout(**self._arguments(world_size, model, known), devices_per_node=devices_per_node)

    def _arguments(self, world_size: int, model: Optional[ModelShape], known: dict) -> dict:
        fields = {name: getattr(self, name) for name in LayoutRequest.__dataclass_fields__}
        return {**fields, **known, "world_size": world_size, "model": model}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout(LayoutRequest, RankGrid):
    """World size split into tensor (tp), context (cp), pipeline (pp), data (dp) and replica (rep) axes.

    Context-parallel ranks split each sequence of a micro-batch (see ``lightning_mgpu.parallel.context``); they hold
    the same weights, so their gradients are reduced, and ZeRO partitions, over the data x context ranks of a model
    shard (group ``"dp_cp"``): that is exactly the set of ranks whose gradients sum to the replica's, and partitioning
    over it divides optimizer memory by ``D * C`` instead of ``D``.

    Build it with keyword arguments; construction validates every rule at once and raises one
    ``ValueError`` that lists each problem with its value, the rule and the fix. Process groups are
    created later, by :meth:`init_groups`, once ``torch.distributed`` is initialised.
    """

    world_size: int  #: with the request's fields (every axis, ZeRO, schedule, micro-batches, offload)
    devices_per_node: Optional[int] = None
    model: Optional[ModelShape] = None
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(format_problems("Invalid parallel layout", problems))
        T, devices = self.tensor_parallel_size, self.devices_per_node
        if devices and T > devices:
            warnings.warn(
                f"tensor_parallel_size={T} is larger than the {devices} devices of one node: every layer's "
                "all-reduce will cross the slow inter-node interconnect. Prefer tensor_parallel_size <= "
                f"{devices} and use pipeline or data parallelism across nodes.",
                stacklevel=2,
            )

    # ----------------------------------------------------------------------------------- validation
    def problems(self) -> list[Problem]:
        """Every rule this layout breaks (empty when valid)."""
        out: list[Problem] = []
        W, T, P, V = self.world_size, self.tensor_parallel_size, self.pipeline_parallel_size, self.virtual_pipeline_size
        C, R = self.context_parallel_size, self.replicas
        for name, value in (("world_size", W), ("tensor_parallel_size", T), ("pipeline_parallel_size", P),
                            ("virtual_pipeline_size", V), ("context_parallel_size", C), ("replicas", R)):
            if not isinstance(value, int) or value < 1:
                out.append(Problem(name, value, "must be a positive integer", "use 1 to disable this axis"))
        if out:
            return out
        data = W // (T * C * P) if W % (T * C * P) == 0 else None
        copies = copies_inside(T, C, data // R if data and data % R == 0 else 1, self.zero_stage)
        out += replica_problems(data, R, self.replica_update, self.sync_every,
                                bool(self.offload_optimizer or self.offload_params), self.max_staleness, copies)
        if W % (T * C * P) != 0:
            valid = [d for d in divisors(W) if W % (d * C * P) == 0]
            what = f"tensor_parallel_size*pipeline_parallel_size={T}*{P}={T * P}" if C == 1 else \
                f"tensor*context*pipeline_parallel_size={T}*{C}*{P}={T * C * P}"
            if valid or C == 1:
                fix = (f"with pipeline_parallel_size={P}{'' if C == 1 else f' and context_parallel_size={C}'} choose "
                       f"tensor_parallel_size from {_fmt(valid)}")
            else:
                contexts = [c for c in divisors(W) if W % (T * c * P) == 0]
                fix = (f"with tensor_parallel_size={T} and pipeline_parallel_size={P} choose context_parallel_size "
                       f"from {_fmt(contexts)}")
            out.append(Problem("world_size", W, f"is not divisible by {what}",
                               f"the world must hold whole copies of the model: {fix}, or change the number of devices"))
        if self.zero_stage not in (0, 1, 2, 3):
            out.append(Problem("zero_stage", self.zero_stage, "is not a ZeRO stage", "choose 0, 1, 2 or 3"))
        for name, value in (("offload_optimizer", self.offload_optimizer), ("offload_params", self.offload_params)):
            if value not in OFFLOAD_DEVICES:
                out.append(Problem(name, value, "is not an offload device", "choose None, 'cpu' or 'nvme'"))
        if self.offload_optimizer and self.zero_stage == 0:
            out.append(Problem("offload_optimizer", self.offload_optimizer, "needs ZeRO", "set zero_stage to 1, 2 or 3"))
        if self.offload_params and self.zero_stage != 3:
            out.append(Problem("offload_params", self.offload_params, f"needs ZeRO stage 3 (zero_stage={self.zero_stage})",
                               "set zero_stage=3 or offload_params=None"))
        if self.sequence_parallel and T == 1:
            out.append(Problem("sequence_parallel", True, "needs tensor_parallel_size > 1",
                               "set tensor_parallel_size or sequence_parallel=False"))
        out += self._pipeline_problems()
        out += self._model_problems()
        m = self.model
        out += expert_problems(self.expert_parallel_size, data // R * C if data and data % R == 0 else None,
                               None if m is None else m.num_experts, T, None if m is None else m.expert_hidden,
                               m is None or m.experts_split)
        return out

    def _pipeline_problems(self) -> list[Problem]:
        out: list[Problem] = []
        P, V, s, M = self.pipeline_parallel_size, self.virtual_pipeline_size, self.pipeline_schedule, self.num_microbatches
        if s not in SCHEDULES:
            out.append(Problem("pipeline_schedule", s, "is unknown", f"choose one of {', '.join(SCHEDULES)}"))
            return out
        if P > 1 and s in MULTI_STAGE_SCHEDULES and V < 2:
            out.append(Problem("pipeline_schedule", s, "runs several stages per rank and needs virtual_pipeline_size >= 2 "
                               f"(got {V})", "set virtual_pipeline_size=2"))
        if V > 1 and s not in MULTI_STAGE_SCHEDULES:
            out.append(Problem("virtual_pipeline_size", V, f"needs a multi-stage schedule, but pipeline_schedule={s!r} "
                               "runs one stage per rank", "use 'interleaved_1f1b' or set virtual_pipeline_size=1"))
        if s in V_SCHEDULES and V not in (1, 2):
            out.append(Problem("pipeline_schedule", s, "places exactly 2 stages per rank", "set virtual_pipeline_size=2"))
        if P > 1 and self.zero_stage == 3 and s in ZERO3_INCOMPATIBLE_SCHEDULES:
            out.append(Problem("zero_stage", 3, f"cannot run pipeline_schedule={s!r} (it computes weight gradients "
                               "outside autograd, which ZeRO-3 partitioning cannot follow)",
                               "use 'interleaved_1f1b' or zero_stage=2"))
        if M is not None:
            if not isinstance(M, int) or M < 1:
                out.append(Problem("num_microbatches", M, "must be a positive integer or None (derived from the batch)"))
            elif P > 1 and s != "gpipe" and M < P:
                out.append(Problem("pipeline_schedule", s, f"needs num_microbatches >= pipeline_parallel_size={P} "
                                   f"(got {M})", f"set num_microbatches={P} or more"))
            elif P > 1 and s == "dualpipev" and M < 2 * P:
                out.append(Problem("pipeline_schedule", s, f"needs num_microbatches >= its 2*pipeline_parallel_size="
                                   f"{2 * P} stages (got {M})", f"set num_microbatches={2 * P} or more"))
            elif P > 1 and s in ("interleaved_1f1b", "interleaved_zero_bubble") and M % P != 0:
                out.append(Problem("pipeline_schedule", s, f"needs num_microbatches divisible by pipeline_parallel_size="
                                   f"{P} (got {M})", f"use {max(P, (M // P) * P)} or {(M // P + 1) * P}"))
        return out

    def _model_problems(self) -> list[Problem]:
        m = self.model
        if m is None:
            return []
        out: list[Problem] = []
        T, stages = self.tensor_parallel_size, self.pipeline_parallel_size * self.virtual_pipeline_size
        for what, n in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("ffn_hidden", m.ffn_hidden)):
            if n % T != 0:
                ok = [d for d in divisors(n) if d <= max(T, 8)]
                out.append(Problem("tensor_parallel_size", T, f"does not divide {what}={n}", f"choose {_fmt(ok)}"))
        out += stage_count_problems(stages, m.n_layers)
        out += tied_embedding_problems(self.pipeline_parallel_size, m.tie_embeddings)
        out += qk_norm_problems(T, m.qk_norm)
        out += context_model_problems(self.context_parallel_size, self.pipeline_parallel_size, m.sliding_window,
                                      m.context_with_pipeline)
        return out

    # ------------------------------------------------------------------------------- coordinates
    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks of one replica: ranks that train on different samples and reduce their gradients
        together every step (all of them with one replica)."""
        return self.world_size // (self.tensor_parallel_size * self.context_parallel_size *
                                   self.pipeline_parallel_size * self.replicas)

    def _unchecked(self) -> "ParallelLayout":
        return _UncheckedLayout(**{name: getattr(self, name) for name in self.__dataclass_fields__ if name != "_groups"})

    @property
    def num_stages(self) -> int:
        """Stages of the whole pipeline: ``pipeline_parallel_size * virtual_pipeline_size`` (2 per rank for V shapes)."""
        per_rank = chunks_per_rank(self.pipeline_schedule, self.virtual_pipeline_size)
        return self.pipeline_parallel_size * per_rank

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs (:func:`stage_ids`)."""
        return stage_ids(self.pipeline_parallel_size, self.virtual_pipeline_size, self.pipeline_schedule, pp_rank)

    def stage_owner(self, stage_id: int) -> int:
        """The pipeline rank that runs ``stage_id``."""
        return next(r for r in range(self.pipeline_parallel_size) if stage_id in self.stage_ids(r))

class _UncheckedLayout(ParallelLayout):
    """A layout that skips validation on construction, so its problems can be listed instead of raised."""

    def __post_init__(self) -> None:
        pass


def layout_problems(**kwargs) -> list[Problem]:
    """Every rule the layout ``ParallelLayout(**kwargs)`` would break, without raising (empty when valid)."""
    return _UncheckedLayout(**kwargs).problems()


def chunks_per_rank(schedule: str, virtual_pipeline_size: int) -> int:
    """Stage chunks each pipeline rank holds: two in a V for the V schedules, else ``virtual_pipeline_size``."""
    return 2 if schedule in V_SCHEDULES else virtual_pipeline_size


def stage_ids(pipeline_parallel_size: int, virtual_pipeline_size: int, schedule: str, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs: V-shaped (``r, 2P-1-r``) for the V schedules, otherwise looped
    (``r, r+P, ...``, ``virtual_pipeline_size`` of them). The planner places stages with it too."""
    P = pipeline_parallel_size
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * P - 1 - pp_rank]
    return [pp_rank + k * P for k in range(virtual_pipeline_size)]


def theoretical_bubble(schedule: str, P: int, M: int, V: int = 1) -> float:
    """The schedule's bubble under the usual unit-cost model.

    GPipe and 1F1B: ``(P-1)/(M+P-1)``; interleaved 1F1B and looped BFS with ``V`` stages per rank:
    ``(P-1)/(V*M+P-1)``; zero-bubble schedules (backward split into input and weight gradients, each costing
    as much as a forward): ``(P-1)/(3*V*M+P-1)``, with ``V=2`` for the V-shaped ``zbv`` and ``dualpipev``.
    """
    if schedule in V_SCHEDULES:
        V = 2
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (P - 1) / (V * M + P - 1)
    return (P - 1) / (3 * V * M + P - 1)


def canonical_name(name: str, layout: ParallelLayout, prefix: str = "model.") -> str:
    """A parameter's name independent of layout: the pipeline container's stage key becomes ``prefix``. Initial values
    (``parallelize``) and checkpoints (``lightning_mgpu.checkpoint``) are keyed by it."""
    return prefix + name.split(".", 1)[1] if layout.size("pp") > 1 else name


def container_prefix(module: object) -> str:
    """Where a pipeline stage container's contents sit in the LightningModule without stages: its ``canonical_prefix``
    (a ``transformers`` model at ``llm.``), else ``model.`` (``LLMModule.model``)."""
    return getattr(module, "canonical_prefix", "model.")
