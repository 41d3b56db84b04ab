"""Rank coordinates and process groups of a layout: where each global rank sits on the tensor (tp), context (cp),
pipeline (pp), data (dp) and replica (rep) axes, and the groups along them.

Rank ``r`` has coordinates ``tp = r % T``, ``cp = (r // T) % C``, ``pp = (r // (T * C)) % P``,
``dp = (r // (T * C * P)) % D`` and ``rep = r // (T * C * P * D)``: tensor parallelism is innermost so that, with 8
GPUs a node and ``T`` dividing 8, every tensor-parallel group sits inside one node; context parallelism comes next, so
that its per-layer key/value exchange also stays inside a node whenever ``T * C`` divides the node's GPU count.
Pipeline stages exchange one activation per micro-batch and data-parallel ranks one gradient reduction per step, so
they take the slower links across nodes. Replicas (``replicas > 1``, ``replica_update="local"``) are outermost: they
exchange weights once every ``sync_every`` steps, over the slowest links (another building, another site).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The axes, innermost first.
AXES = ("tp", "cp", "pp", "dp", "rep")
#: The groups a layout creates, by the axes their members differ in. "dp_cp": the data x context ranks that hold the
#: same parameter shard (ZeRO partitions and gradients reduce over them, inside a replica); "mp": the tp x pp ranks of
#: one sequence part (their parameters make up the whole model once); "rep": the ranks at the same place of every
#: replica (the outer step reduces over them); "replica": every rank of one replica (what Lightning's per-batch checks
#: reach when replicas step apart).
GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("cp", "dp"), "mp": ("tp", "pp"),
          "rep": ("rep",), "replica": ("tp", "cp", "pp", "dp")}
#: Groups folded over each "dp_cp" group (in its rank order) by ``expert_parallel_size`` Ep: "ep", runs of Ep
#: consecutive ranks, which hold disjoint experts and exchange tokens; "edp", the ranks at the same place of every run,
#: which hold the same experts (their gradients reduce, and ZeRO partitions them, over it).
FOLDED = ("ep", "edp")


@dataclass(frozen=True)
class GroupCoordinates:
    """A process group given by this rank's place in it, without one: layers built with it have the shapes of rank
    ``rank`` of ``size`` and cannot run collectives (the dry run splits a model on the meta device for every rank of a
    layout this way, in one process; see :meth:`RankGrid.planned_at`)."""

    rank: int
    size: int


class RankGrid:
    """Coordinates and groups, for a layout with ``world_size`` and the axis sizes (a mixin of ``ParallelLayout``)."""

    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tensor_parallel_size, "cp": self.context_parallel_size, "pp": self.pipeline_parallel_size,
                "dp": self.data_parallel_size, "rep": self.replicas}

    def size(self, axis: str) -> int:
        """Ranks along ``axis`` (an axis, a group of :data:`GROUPS`, or "data": every rank that reads its own samples,
        data-parallel ranks of every replica)."""
        if axis == "data":
            return self.data_parallel_size * self.replicas
        if axis in FOLDED:
            Ep = self.expert_parallel_size
            return Ep if axis == "ep" else self.size("dp_cp") // Ep
        sizes = self._sizes()
        n = 1
        for part in GROUPS[_check_group(axis)]:
            n *= sizes[part]
        return n

    def coords(self, global_rank: int) -> dict[str, int]:
        """The (tp, cp, pp, dp, rep) coordinates of ``global_rank``; tp is innermost."""
        out, rest = {}, global_rank
        for axis, n in self._sizes().items():
            out[axis], rest = rest % n, rest // n
        return out

    def global_rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0, rep: int = 0) -> int:
        """The global rank at the given coordinates (inverse of :meth:`coords`)."""
        T, C, P, D = self.tensor_parallel_size, self.context_parallel_size, self.pipeline_parallel_size, \
            self.data_parallel_size
        return tp + T * (cp + C * (pp + P * (dp + D * rep)))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (a key of :data:`GROUPS`), each the ascending global ranks that differ only in
        that group's axes."""
        if axis in FOLDED:
            Ep = self.expert_parallel_size
            folded = [g[i:i + Ep] for g in self.group_ranks("dp_cp") for i in range(0, len(g), Ep)] if axis == "ep" \
                else [g[j::Ep] for g in self.group_ranks("dp_cp") for j in range(Ep)]
            return folded
        varying = GROUPS[_check_group(axis)]
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            fixed = tuple(v for a, v in self.coords(r).items() if a not in varying)
            groups.setdefault(fixed, []).append(r)
        return list(groups.values())

    def init_groups(self, global_rank: int, timeout=None) -> None:
        """Create this rank's process group of every kind in :data:`GROUPS`, with the collective ``timeout`` (a
        ``timedelta``; torch's ``new_group`` does not inherit the world group's, it would wait 30 minutes on gloo).

        Every rank must call this in the same order, since ``new_group`` is collective over the world.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelLayout.init_groups needs torch.distributed to be initialised first")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"layout world_size={self.world_size} but torch.distributed has "
                               f"{dist.get_world_size()} ranks")
        self._groups.clear()
        self._groups["rank"] = global_rank
        folded = FOLDED if self.expert_parallel_size > 1 else ()
        for axis in (*GROUPS, *folded):
            for ranks in self.group_ranks(axis):
                # named by its kind: a trace's distributedInfo and NCCL's collective records and errors say "tp"
                group = dist.new_group(ranks, timeout=timeout, group_desc=axis)
                if global_rank in ranks:
                    self._groups[axis] = group
        if not folded:  # no expert parallelism: every rank holds every expert
            self._groups["edp"] = self._groups["dp_cp"]

    def planned_at(self, global_rank: int):
        """This layout as rank ``global_rank`` sees it, without ``torch.distributed``: :meth:`rank` answers, and
        :meth:`group` gives :class:`GroupCoordinates` instead of process groups (for the dry run)."""
        view = self._unchecked()
        view._groups["rank"] = global_rank
        view._groups.update({axis: GroupCoordinates(view.rank(axis), self.size(axis)) for axis in (*GROUPS, *FOLDED)})
        return view

    def group(self, axis: str):
        """This rank's process group along ``axis`` (a key of :data:`GROUPS`); needs :meth:`init_groups`."""
        if axis not in self._groups:
            raise RuntimeError(f"no process group for axis {axis!r}: call init_groups() after init_process_group")
        return self._groups[axis]

    def rank(self, axis: str) -> int:
        """This rank's place along ``axis``: its coordinate, its index in its group of :data:`GROUPS` (in the order of
        :meth:`group_ranks`), or for "data" ``rep * D + dp``; needs :meth:`init_groups`."""
        if "rank" not in self._groups:
            raise RuntimeError("ParallelLayout.rank needs init_groups() first")
        if axis in FOLDED:
            index = self.rank("dp_cp")
            return index % self.expert_parallel_size if axis == "ep" else index // self.expert_parallel_size
        coords, sizes = self.coords(self._groups["rank"]), self._sizes()
        parts = ("dp", "rep") if axis == "data" else GROUPS[_check_group(axis)]
        index, scale = 0, 1
        for part in AXES:  # innermost first: the ascending order of the group's ranks
            if part in parts:
                index, scale = index + coords[part] * scale, scale * sizes[part]
        return index


def _check_group(axis: str) -> str:
    if axis not in GROUPS and axis not in FOLDED:
        raise ValueError(f"axis={axis!r} is unknown; choose one of {', '.join(GROUPS)} (or 'data' for sizes)")
    return axis
