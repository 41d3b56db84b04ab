"""A run of replicas stepping apart (``replica_update="local"``), checkpointed in the middle of a round: resumed, it
ends bit for bit where the uninterrupted run ends; resumed into another layout inside each replica, it ends where
that run ends to rounding; resumed with other replica settings, it is refused by name."""

import re

import pytest
from test_replicas import DILOCO, fit_weights, replica_means, weight_diff

from helpers import in_turn, max_abs_diff
from lightning_mgpu.callbacks import PeriodicCheckpoint
from lightning_mgpu.testing import run_distributed

LOCAL = dict(replicas=2, replica_update="local", sync_every=3, outer_optimizer=DILOCO)
STEPS = 6
INSIDE = {"zero3": dict(zero_stage=3), "tp2": dict(tensor_parallel_size=2, zero_stage=1)}
NOW = {"sync": dict(replicas=1, replica_update="sync"), "local": dict(replicas=1, replica_update="local")}


def resume(rank: int, token_file, directory, step: int, **kw) -> object:
    """``fit_weights`` from the checkpoint of ``step``, after a barrier: every rank has left the run that wrote it.
    A refusal is returned as its message (what a launch of this fit alone would raise)."""
    import torch.distributed as dist

    dist.barrier()
    try:
        return fit_weights(rank, token_file, 4, max_steps_=STEPS, ckpt_path=str(directory / f"step-{step:08d}"), **kw)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def runs(token_file, tmp_path_factory):
    """6 steps of 2 replicas of 2 ZeRO-1 ranks, H=3, a checkpoint every 2 steps: step 2 and step 4 are each in the
    middle of a round (the outer steps come after steps 3 and 6); then, on the same 4 processes with a fresh Trainer
    each, every resume of the tests below (one launch each cost every rank its start-up 6 times)."""
    directory = tmp_path_factory.mktemp("replica_checkpoints")
    calls = {"uninterrupted": (fit_weights, (token_file, 4), dict(
        max_steps_=STEPS, zero_stage=1, callbacks=(PeriodicCheckpoint(directory, 2, keep_last=3),), **LOCAL))}
    calls["resumed"] = (resume, (token_file, directory, 4), dict(zero_stage=1, **LOCAL))
    calls.update({name: (resume, (token_file, directory, 2), dict(**inside, **LOCAL)) for name, inside in INSIDE.items()})
    calls.update({f"now_{name}": (resume, (token_file, directory, 4), dict(zero_stage=1, **now))
                  for name, now in NOW.items()})
    results = run_distributed(in_turn, 4, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


def test_a_round_resumes_bit_identically(runs):
    for whole, again in zip(runs["uninterrupted"], runs["resumed"]):
        assert weight_diff(whole["weights"], again["weights"]) == 0.0, whole["rank"]
        assert again["losses"] == whole["losses"][4:]  # steps 5 and 6: each replica's own batches and weights


@pytest.mark.parametrize("inside", list(INSIDE))
def test_a_round_reshards_inside_each_replica(runs, inside):
    """From step 2 into ZeRO-3 (2 ranks per replica) or tp2 (one tensor-parallel model per replica): each replica's
    own weights and moments and the outer weights and momentum are read into the new shards; the losses of steps 3-6
    (which cross both outer steps) are the uninterrupted run's."""
    resumed, uninterrupted = runs[inside], runs["uninterrupted"]
    assert max_abs_diff(replica_means(resumed, 2), replica_means(uninterrupted, 2)[2:]) < 1e-5
    if inside == "zero3":  # (tp2's ranks hold shards)
        assert weight_diff(resumed[0]["weights"], uninterrupted[0]["weights"]) < 1e-5


@pytest.mark.parametrize("now", list(NOW))
def test_other_replica_settings_are_refused_by_name(runs, now):
    """Another update rule, or the same rule with another number of replicas."""
    for refusal in runs[f"now_{now}"]:
        assert isinstance(refusal, str) and re.search(
            rf"replicas=2, replica_update='local' and this run trains with replicas=1, replica_update='{now}'",
            refusal), refusal
