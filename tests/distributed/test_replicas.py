"""Replicas that synchronise every H steps (``replica_update="local"``): against ``sync`` where the two must agree,
against a one-process simulation of DiLoCo, and what the outer step sends."""


import bisect
import os
import threading
import time
import traceback
from typing import Optional

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import GLOBAL_BATCH, OPTIM, TINY, fit, global_batches, in_turn, max_abs_diff

from lightning_mgpu import LLMModule
from lightning_mgpu.checkpoint.consolidate import consolidated_state_dict
from lightning_mgpu.engine import ParameterState
from lightning_mgpu.resilience import collective_trace
from lightning_mgpu.testing import run_distributed

STEPS = 4
INNER_LR = 0.05
AVERAGING = {"name": "sgd", "lr": 1.0, "momentum": 0.0}  # the outer step that makes local with H=1 equal sync
DILOCO = {"name": "nesterov", "lr": 0.7, "momentum": 0.9}


class SGDModule(LLMModule):
    """Plain SGD at a constant LR: with it, one inner step of each replica then the average of their changes is the
    synchronous step exactly."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=INNER_LR)


class FinalWeights(L.Callback):
    """This rank's share of every fp32 master weight once fit has ended (gathered from ZeRO's partitions): after the
    strategy's ``on_train_end``, which ends a round cut short."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.sampler: dict = {}
        self.traffic = None
        self.whole: Optional[dict[str, torch.Tensor]] = None  #: every whole weight by its model name (rank 0)

    def on_fit_end(self, trainer, module) -> None:
        self.sampler = trainer.strategy.distributed_sampler_kwargs  # what a user's DataLoader is sharded by
        sync = trainer.strategy._replica_sync  # replica_update="async": elements to and from the other replicas
        self.traffic = (sync.rounds, sync.anchor.numel(), sync.owner.weights.numel(), sync.sent_elements,
                        sync.received_elements) if hasattr(sync, "sent_elements") else None
        state = ParameterState(trainer.strategy.model)
        self.weights = {name: state.get(p, None) for name, p in trainer.strategy.model.module.named_parameters()}
        layout = trainer.strategy.layout
        if layout.size("tp") > 1 or layout.size("pp") > 1:  # shards and stages, put together on global rank 0
            self.whole = consolidated_state_dict(trainer.strategy.model, layout)


def fit_weights(rank: int, token_file, devices: int, module_cls=LLMModule, max_steps_: int = STEPS,
                seeds_apart: bool = False, callbacks: tuple = (), **kw) -> dict:
    """``seeds_apart``: each replica builds its model from its own seed (the first two ranks 0, the others 1)."""
    weights = FinalWeights()
    module = module_cls(TINY, **OPTIM, global_batch_size=GLOBAL_BATCH, init_seed=rank // 2 if seeds_apart else 0)
    out = fit(rank, token_file, devices, max_steps=max_steps_, clip=None, module=module,
              callbacks=[weights, *callbacks], **kw)
    return {**out, "weights": weights.weights, "sampler": weights.sampler, "traffic": weights.traffic,
            "whole": weights.whole}


def replica_means(results: list[dict], replicas: int) -> list[float]:
    """The loss of each step over the whole global batch: the mean of the replicas' (equal shares) losses."""
    per_replica = [results[r * len(results) // replicas]["losses"] for r in range(replicas)]
    return [sum(step) / replicas for step in zip(*per_replica)]


def weight_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


LAYOUTS = {"zero0": dict(zero_stage=0), "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2),
           "zero3": dict(zero_stage=3), "tp2": dict(tensor_parallel_size=2, zero_stage=1),
           "pp2": dict(pipeline_parallel_size=2, zero_stage=1)}


#: The layouts of the DiLoCo comparison.
DILOCO_LAYOUTS = ["zero1", "zero3", "tp2", "pp2"]
#: The ZeRO stages whose traffic is traced.
TRACED = ["zero1", "zero3"]


def _four_rank_calls(token_file) -> dict:
    """Every untraced fit of this file on 4 processes, by name."""
    calls = {}
    for name, layout in LAYOUTS.items():
        calls[f"sync_{name}"] = (fit_weights, (token_file, 4, SGDModule), layout)
        calls[f"local_{name}"] = (fit_weights, (token_file, 4, SGDModule), dict(
            replicas=2, replica_update="local", sync_every=1, outer_optimizer=AVERAGING, **layout))
    for name in DILOCO_LAYOUTS:
        calls[f"diloco_{name}"] = (fit_weights, (token_file, 4), dict(
            replicas=2, replica_update="local", sync_every=2, outer_optimizer=DILOCO, **LAYOUTS[name]))
    calls["cut_short"] = (fit_weights, (token_file, 4), dict(
        max_steps_=3, seeds_apart=True, replicas=2, replica_update="local", sync_every=2, zero_stage=1,
        check_layout=False))
    return calls


@pytest.fixture(scope="module")
def four(token_file) -> dict[str, list]:
    """The untraced 4-process fits of the tests below in one launch, each with a fresh Trainer (one launch per fit
    cost each rank its start-up 17 times): each fit's results of every rank, by name. The traced fits have launches of
    their own: their Flight Recorder of 100,000 entries, once set, stays for the process, and the liveness thread
    reads all of it every 0.5 s (this file took 325 s of CPU with them in this launch, 88 s without)."""
    calls = _four_rank_calls(token_file)
    results = run_distributed(in_turn, 4, calls, timeout=900)
    return {name: [r[name] for r in results] for name in calls}


@pytest.fixture(scope="module")
def traced(token_file) -> dict[str, list]:
    """The traced 4-process fits in one launch of their own (as ``four``)."""
    calls = {}
    for name in TRACED:
        calls[f"local_{name}"] = (traced_fit, (token_file,), dict(
            replicas=2, replica_update="local", sync_every=2, outer_optimizer=DILOCO, **LAYOUTS[name]))
        calls[f"sync_{name}"] = (traced_fit, (token_file,), LAYOUTS[name])
    results = run_distributed(in_turn, 4, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


@pytest.fixture(scope="module")
def two(token_file) -> dict[str, list]:
    """The untraced 2-process fits of the tests below in one launch (as ``four``)."""
    kw = dict(zero_stage=1, replica_update="local", sync_every=2)
    calls = {"plain": (fit_weights, (token_file, 2), dict(zero_stage=1)),
             "averaged": (fit_weights, (token_file, 2), dict(outer_optimizer=AVERAGING, **kw)),
             "diloco": (fit_weights, (token_file, 2), dict(outer_optimizer=DILOCO, **kw))}
    results = run_distributed(in_turn, 2, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_local_with_one_inner_step_and_averaging_equals_sync(four, name):
    """H=1, an SGD inner optimizer and an outer SGD of lr 1 without momentum: each outer step applies the mean of
    the replicas' SGD steps, which is the synchronous SGD step over the whole global batch."""
    sync, local = four[f"sync_{name}"], four[f"local_{name}"]
    assert max_abs_diff(replica_means(local, 2), sync[0]["losses"]) < 1e-6
    for s, lo in zip(sync, local):  # the same place in the layout: the same share of the weights
        assert weight_diff(s["weights"], lo["weights"]) < 1e-6, (s["rank"], weight_diff(s["weights"], lo["weights"]))
    assert sync[0]["losses"][-1] < sync[0]["losses"][0]  # it trains: the comparison means something


def test_one_replica_averaged_with_itself_is_plain_training_bit_for_bit(two):
    """``replicas=1`` under ``local`` with the averaging outer step (SGD, lr 1, no momentum) is plain training: the
    same losses and weights, bit for bit (the identity outer step is not computed); DiLoCo's outer step is not."""
    plain, averaged, diloco = two["plain"], two["averaged"], two["diloco"]
    for p, a, d in zip(plain, averaged, diloco):
        assert a["losses"] == p["losses"] and weight_diff(p["weights"], a["weights"]) == 0.0
        assert weight_diff(p["weights"], d["weights"]) > 1e-4


def diloco_reference(token_file, replicas: int, sync_every: int, outer: dict, steps: int = STEPS,
                     average_moments: bool = False) -> dict:
    """DiLoCo in one process: ``replicas`` copies of the tiny Llama, each with its own AdamW and LR schedule on its
    contiguous share of every global batch; every ``sync_every`` steps the mean of their changes since the last
    outer step drives an outer SGD (Nesterov) step, from which every copy continues. Written here independently of
    ``lightning_mgpu.parallel.replicas``. ``average_moments``: the wrong variant that also averages Adam's state."""
    copies = []
    for _ in range(replicas):
        module = LLMModule(TINY, **OPTIM, global_batch_size=GLOBAL_BATCH)
        module.configure_model()
        cfg = module.configure_optimizers()
        copies.append((module, cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]))
    params = [list(m.model.parameters()) for m, _, _ in copies]
    anchors = [p.detach().clone().requires_grad_(False) for p in params[0]]
    outer_opt = torch.optim.SGD(anchors, lr=outer["lr"], momentum=outer["momentum"],
                                nesterov=outer["name"] == "nesterov")
    losses = []
    share = GLOBAL_BATCH // replicas
    for step, batch in enumerate(global_batches(token_file, steps, GLOBAL_BATCH, 16, 7, 0.01)):
        step_losses = []
        for r, (module, opt, sched) in enumerate(copies):
            rows = batch[r * share:(r + 1) * share]
            loss = F.cross_entropy(module.model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / replicas)
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for i, anchor in enumerate(anchors):
                    anchor.grad = sum(anchor - params[r][i] for r in range(replicas)) / replicas
                outer_opt.step()
                for r in range(replicas):
                    for i, anchor in enumerate(anchors):
                        params[r][i].copy_(anchor)
            if average_moments:
                _average_adam_states([opt for _, opt, _ in copies])
    return {"losses": losses,  # named as the engine names them: its module is the LightningModule
            "weights": {f"model.{n}": p.detach().clone() for n, p in copies[0][0].model.named_parameters()}}


def _average_adam_states(optimizers: list) -> None:
    groups = [[p for g in opt.param_groups for p in g["params"]] for opt in optimizers]
    with torch.no_grad():
        for i in range(len(groups[0])):
            for key in ("exp_avg", "exp_avg_sq"):
                mean = sum(opt.state[groups[k][i]][key] for k, opt in enumerate(optimizers)) / len(optimizers)
                for k, opt in enumerate(optimizers):
                    opt.state[groups[k][i]][key].copy_(mean)


@pytest.mark.parametrize("name", DILOCO_LAYOUTS)
def test_diloco_equals_a_one_process_simulation_of_its_replicas(token_file, four, name):
    """AdamW inner, Nesterov outer (lr 0.7, momentum 0.9), H=2 over 4 steps, 2 replicas (of 2 data-parallel ranks, or
    of one tp2 or pp2 model): the per-step loss over the global batch equals the simulation's, and the final weights
    too (a tp2 or pp2 model's put together from its shards or stages); a simulation that also averages Adam's moments, or uses
    another outer lr, does not."""
    local = four[f"diloco_{name}"]
    expected = diloco_reference(token_file, 2, 2, DILOCO)
    assert max_abs_diff(replica_means(local, 2), expected["losses"]) < 1e-6
    # every rank of every replica reads its own share of a user's DataLoader too
    data_ranks = 4 // (LAYOUTS[name].get("tensor_parallel_size", 1) * LAYOUTS[name].get("pipeline_parallel_size", 1))
    assert sorted({tuple(r["sampler"].items()) for r in local}) == \
        [(("num_replicas", data_ranks), ("rank", k)) for k in range(data_ranks)]
    final, tol = local[0]["weights"], 1e-6
    if name in ("tp2", "pp2"):  # ranks hold shards or stages: the whole weights, put together after the last outer step
        final, tol = {f"model.{k}": v for k, v in local[0]["whole"].items()}, 1e-5  # split matmuls round apart
        assert sorted(final) == sorted(expected["weights"])
    assert weight_diff(final, expected["weights"]) < tol
    wrong_lr = diloco_reference(token_file, 2, 2, {**DILOCO, "lr": 0.5})
    moments = diloco_reference(token_file, 2, 2, DILOCO, average_moments=True)
    for wrong in (wrong_lr, moments):
        assert weight_diff(final, wrong["weights"]) > 1e-4
        assert max_abs_diff(replica_means(local, 2), wrong["losses"]) > 1e-5  # the losses see it too


#: The torch.distributed functions whose callers the trace records (what issued each operation).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
#: Flight Recorder entries kept per process while tracing: more than a short fit issues.
TRACE_ENTRIES = 100_000


class CollectiveTrace(L.Callback):
    """Every operation on any process group during ``fit``'s training, as the process groups recorded it (the Flight
    Recorder: functional collectives and a group's own methods count too), with the step it ran in (the optimizer
    steps done before it), its group's ranks, its elements, and who called it: the functions on the stack of the
    torch.distributed function that issued it (an empty set for one issued another way). Build it before ``fit``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        os.environ[collective_trace.BUFFER_VARIABLE] = str(TRACE_ENTRIES)  # before the first group exists
        self.calls: list[tuple] = []
        self.windows: list[tuple[int, int, int, set]] = []  #: (thread, start ns, end ns, callers) of each call
        self.groups: dict[str, tuple[int, ...]] = {}  #: group name -> its global ranks
        self.boundaries: list[int] = []
        self.training, self.step_seen = False, 0
        #: torch.distributed's own functions, put back when training ends: a later fit in the same process must see
        #: them (``P2POp`` accepts only the very ``dist.isend`` and ``dist.irecv``)
        self.originals = {name: getattr(dist, name) for name in (*COLLECTIVES, "new_group")}
        for name in COLLECTIVES:
            setattr(dist, name, self._traced(getattr(dist, name)))
        new_group = dist.new_group

        def recorded_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                self.groups[group.group_name] = tuple(dist.get_process_group_ranks(group))
            return group

        dist.new_group = recorded_group

    def _traced(self, original):
        def traced(*args, **kwargs):
            if not self.training:
                return original(*args, **kwargs)
            callers = {frame.name for frame in traceback.extract_stack()}
            begin = time.time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.windows.append((threading.get_ident(), begin, time.time_ns(), callers))
        return traced

    def on_train_start(self, trainer, *args) -> None:
        import torch.distributed as dist

        self.groups[dist.group.WORLD.group_name] = tuple(range(dist.get_world_size()))
        self.training, self.start_ns = True, time.time_ns()

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self.step_seen:  # an optimizer step ended
            self.step_seen = trainer.global_step
            self.boundaries.append(time.time_ns())

    def on_train_end(self, trainer, *args) -> None:
        import torch.distributed as dist

        self.training, end = False, time.time_ns()
        for name, original in self.originals.items():
            setattr(dist, name, original)
        entries = collective_trace.recorded()
        assert len(entries) < TRACE_ENTRIES, "the Flight Recorder overflowed: raise TRACE_ENTRIES"
        for e in (e for e in entries if self.start_ns <= e["created_ns"] <= end):
            inside = [w for w in self.windows if w[0] == e["thread"] and w[1] <= e["created_ns"] <= w[2]]
            callers = max(inside, key=lambda w: w[1])[3] if inside else set()  # the innermost call
            self.calls.append((bisect.bisect(self.boundaries, e["created_ns"]), e["op"], self.groups[e["group"]],
                               e["elements"], callers))


def traced_fit(rank: int, token_file, **kw) -> dict:
    trace = CollectiveTrace()
    module = LLMModule(TINY, **OPTIM, global_batch_size=GLOBAL_BATCH)
    fit(rank, token_file, 4, max_steps=STEPS, clip=None, module=module, callbacks=[trace], **kw)
    from lightning_mgpu.engine import master_weights

    return {"rank": rank, "calls": trace.calls,
            "share": sum(m.numel() for m in master_weights(module.trainer.strategy.model))}


class OtherWays(L.Callback):
    """After the first step: a functional all-reduce of 5 elements and the world group's own all-reduce of 3, neither
    through torch.distributed's functions."""

    def on_train_batch_end(self, trainer, *args) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        if trainer.global_step == 1:
            funcol.wait_tensor(funcol.all_reduce(torch.ones(5), "sum", dist.group.WORLD))
            dist.group.WORLD.allreduce([torch.ones(3)]).wait()


def other_ways_fit(rank: int, token_file) -> list:
    trace = CollectiveTrace()
    fit(rank, token_file, 2, max_steps=2, clip=None, callbacks=[trace, OtherWays()], zero_stage=1)
    return trace.calls


def test_the_trace_sees_functional_collectives_and_a_groups_own_methods(token_file):
    for calls in run_distributed(other_ways_fit, 2, token_file):
        unnamed = [(step, op, ranks, n) for step, op, ranks, n, callers in calls if not callers]
        assert unnamed == [(1, "all_reduce", (0, 1), 5), (1, "all_reduce", (0, 1), 3)], unnamed
        assert any(callers for *_, callers in calls)  # the engine's own, through torch.distributed


#: Collectives over every rank that are not the outer step's, by a function that calls them: ZeRO-3's check, once
#: after its first step, that every rank traced its modules in the same order. (Lightning's one-element broadcast of
#: rank 0's SIGTERM flag before every batch stays inside each replica: ``keep_sigterm_check_inside_replicas``.)
NOT_OURS = {"assert_ints_same_as_other_ranks": "zero3 trace check"}


def crossing_elements(result: dict) -> int:
    """Elements of the collectives of ``result``'s rank that reach the other half of the 4 ranks."""
    return sum(n for _, _, ranks, n, _ in result["calls"] if len({x // 2 for x in ranks}) > 1)


@pytest.mark.parametrize("name", TRACED)
def test_replicas_talk_only_at_outer_steps_and_send_each_share_once(traced, name):
    """2 replicas of 2 ranks, H=2 over 4 steps: the outer step is the only collective that reaches the other replica
    (besides ZeRO-3's order check after its first step), after steps 2 and 4 only: one all-reduce per master tensor
    over the ranks at the same place of each replica, together this rank's share of the weights; in all at most 1/H
    of the elements ``sync`` sends across the same halves of the ranks over the same steps."""
    results, sync = traced[f"local_{name}"], traced[f"sync_{name}"]
    for r, s in zip(results, sync):
        assert 0 < crossing_elements(r) <= crossing_elements(s) / 2, (crossing_elements(r), crossing_elements(s))
        crossing = [c for c in r["calls"] if len({x // 2 for x in c[2]}) > 1]
        outer = [(step, op, ranks, n) for step, op, ranks, n, callers in crossing if "outer_step" in callers]
        others = [(step, op, n, [NOT_OURS[f] for f in NOT_OURS if f in callers])
                  for step, op, ranks, n, callers in crossing if "outer_step" not in callers]
        assert all(owner for *_, owner in others), [o for o in others if not o[-1]][:3]
        assert {step for step, *_ in outer} == {1, 3}  # the steps that end a round of H=2 (global_step counts from 0)
        for step in (1, 3):
            ops = [(op, ranks) for s, op, ranks, _ in outer if s == step]
            # over this rank and its counterpart in the other replica (replicas of 2 ranks: rank +- 2), nobody else
            assert {op for op, _ in ops} == {"all_reduce"}, ops
            assert {ranks for _, ranks in ops} == {(r["rank"] % 2, r["rank"] % 2 + 2)}, ops
            assert sum(n for s, *_, n in outer if s == step) == r["share"]


def test_replicas_start_together_and_a_round_cut_short_ends_with_its_outer_step(four):
    """Replicas whose modules were built from different seeds start from replica 0's weights; 3 steps at H=2 leave
    a last round of one inner step, which the last step ends with its outer step: both replicas end with the same
    weights (rank 0 and its counterpart, rank 2)."""
    results = four["cut_short"]
    assert weight_diff(results[0]["weights"], results[2]["weights"]) == 0.0
    assert weight_diff(results[1]["weights"], results[3]["weights"]) == 0.0
