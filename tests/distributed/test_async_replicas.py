"""Replicas that synchronise asynchronously (``replica_update="async"``): in lockstep (a staleness bound of 0) the
arithmetic of DiLoCo's one-process simulation, and with a slow rank, who waits for whom under each update rule."""

import re

import pytest
from helpers import in_turn, max_abs_diff
from test_replicas import DILOCO, LAYOUTS, diloco_reference, fit_weights, replica_means, weight_diff

from lightning_mgpu import LLMModule
from lightning_mgpu.testing import run_distributed


LOCKSTEP = ["zero1", "zero3", "tp2"]


@pytest.fixture(scope="module")
def lockstep(token_file) -> dict[str, list]:
    """The lockstep runs of every layout below in one launch of 4 processes, each with a fresh Trainer: each run's
    results of every rank, by layout name."""
    kw = dict(replicas=2, replica_update="async", sync_every=2, max_staleness=0, outer_optimizer=DILOCO)
    calls = {name: (fit_weights, (token_file, 4), dict(kw, **LAYOUTS[name])) for name in LOCKSTEP}
    results = run_distributed(in_turn, 4, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", LOCKSTEP)
def test_async_in_lockstep_equals_diloco(token_file, lockstep, name):
    """``max_staleness=0``: every pull waits for both replicas' push of the round, so the sharded global weights,
    the owners' outer steps and the point-to-point pushes and pulls give DiLoCo's one-process simulation (AdamW
    inner, Nesterov outer, H=2, 2 replicas): the per-step losses, and the final weights (a tp2 model's put together
    from its shards); a wrong outer lr does not."""
    results = lockstep[name]
    expected = diloco_reference(token_file, 2, 2, DILOCO)
    assert max_abs_diff(replica_means(results, 2), expected["losses"]) < 1e-6
    for r in results:  # per round, the other replica's slice of the pseudo-gradient out and of the weights back
        rounds, share, own, sent, received = r["traffic"]
        assert rounds == 2 and sent == rounds * (share - own) and received == sent + (share - own)  # + the final pull
    final, tol = results[0]["weights"], 1e-6
    if name == "tp2":  # ranks hold shards: the whole weights after the last pull, put together on rank 0
        final, tol = {f"model.{k}": v for k, v in results[0]["whole"].items()}, 1e-5  # split matmuls round apart
        assert sorted(final) == sorted(expected["weights"])
    else:
        assert weight_diff(results[0]["weights"], results[2]["weights"]) == 0.0  # both replicas end on the same
    assert weight_diff(final, expected["weights"]) < tol
    wrong = diloco_reference(token_file, 2, 2, {**DILOCO, "lr": 0.5})
    assert weight_diff(final, wrong["weights"]) > 1e-4


def _refusal(rank: int, token_file) -> str:
    try:
        fit_weights(rank, token_file, 2, zero_stage=1, replicas=2, replica_update="async",
                    trainer_kw=dict(enable_checkpointing=True))
    except Exception as err:  # what a launch of this fit alone would raise
        return f"{type(err).__name__}: {err}"
    return "trained"


def test_async_with_a_checkpoint_callback_is_refused_before_training(two):
    """Lightning's default ``ModelCheckpoint`` (``enable_checkpointing=True``) would save at the end of the epoch,
    which an ``async`` run cannot: refused at setup, naming the callback and the fix."""
    for refusal in two["refused"]:
        assert re.search(r"cannot save or resume checkpoints.*ModelCheckpoint in the callbacks; "
                         r"Trainer\(enable_checkpointing=False\)", refusal, re.S), refusal


COMPUTE_SECONDS = 0.03  # each batch's stand-in for the compute of a larger model (the tiny one takes milliseconds)
SLOW_STEPS = 12


class ComputeModule(LLMModule):
    def training_step(self, batch, batch_idx):
        import time

        time.sleep(COMPUTE_SECONDS)
        return super().training_step(batch, batch_idx)


def timed_fit(rank: int, token_file, **kw) -> dict:
    from helpers import GLOBAL_BATCH, OPTIM, TINY, fit

    from test_replicas import FinalWeights

    module, weights = ComputeModule(TINY, **OPTIM, global_batch_size=GLOBAL_BATCH), FinalWeights()
    fit(rank, token_file, 2, max_steps=SLOW_STEPS, clip=None, module=module, slow_ranks={1: 2.0}, zero_stage=1,
        check_layout=False, callbacks=[weights], **kw)
    clock, sync = module.trainer.strategy._clock, module.trainer.strategy._replica_sync
    return {"rank": rank, "ends": clock.ends, "busy": clock.busy, "report": module.trainer.strategy.straggler_report,
            "weights": weights.weights, "staleness": getattr(sync, "staleness", None)}


def waits(result: dict) -> list[float]:
    """Per step of this rank, the seconds it waited for others: the step's wall time beyond its own busy time."""
    starts = [result["ends"][0] - result["busy"][0]] + result["ends"][:-1]
    return [max(0.0, e - s - b) for s, e, b in zip(starts, result["ends"], result["busy"])]


def waited(result: dict, steps) -> float:
    """The fast rank's total wait over ``steps`` (0-based)."""
    w = waits(result)
    return sum(w[i] for i in steps)


def steps_ahead(fast: dict, slow: dict) -> float:
    """The fast rank's inner steps done against the slow rank's at the same moment (the fast rank's second-last
    step: its last one waits for every replica)."""
    moment = fast["ends"][-2]
    return (len(fast["ends"]) - 1) / max(1, sum(end <= moment for end in slow["ends"]))


SLOW_RUNS = {"sync": {}, "local": dict(replicas=2, replica_update="local", sync_every=2),
             "async": dict(replicas=2, replica_update="async", sync_every=2, max_staleness=8),
             "bounded": dict(replicas=2, replica_update="async", sync_every=2, max_staleness=1)}


@pytest.fixture(scope="module")
def two(token_file) -> dict[str, list]:
    """The 2-process runs of this file in one launch (as ``lockstep``): the slow-rank runs, then the refused one."""
    calls = {name: (timed_fit, (token_file,), kw) for name, kw in SLOW_RUNS.items()}
    calls["refused"] = (_refusal, (token_file,), {})
    results = run_distributed(in_turn, 2, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


def test_a_slow_rank_holds_back_sync_every_step_local_every_round_and_async_never(two):
    """Rank 1 made 2x slower (``slow_ranks={1: 2.0}``), 12 steps. ``sync`` (one replica of 2 ranks): rank 0 waits
    for it at every step. ``local`` (2 replicas of one rank, H=2): only at the steps that end a round. ``async``
    (H=2, at most 8 rounds ahead): never before its last step, and it completes at least 1.5x the slow replica's
    inner steps meanwhile, its rounds starting from stale weights (and the slow one's not); both end on the same
    weights. With at most 1 round ahead, the fast replica waits again. The straggler report names rank 1 in each."""
    results = {name: two[name] for name in SLOW_RUNS}
    for name, (fast, slow) in results.items():
        assert "straggler: rank 1 is busy" in fast["report"], (name, fast["report"])
    # Sums of waits compared between runs, with wide margins: busy cores stretch every step alike. Steps 2, 4, ...
    # (1-based) end local's rounds; the last step waits in every run.
    inside, ends = range(2, SLOW_STEPS - 1, 2), range(1, SLOW_STEPS - 1, 2)  # step 1: start-up
    sync, local, fast_async = results["sync"][0], results["local"][0], results["async"][0]
    slow_extra = sum(results["sync"][1]["busy"][1:-1]) / 2  # what rank 1's slowness adds over those steps
    assert waited(sync, range(1, SLOW_STEPS - 1)) > 0.4 * slow_extra, waits(sync)  # every step
    assert waited(local, inside) < 0.5 * waited(sync, inside), (waits(local), waits(sync))  # not inside rounds
    assert waited(local, ends) > 2 * waited(local, inside), waits(local)  # ... but where they end
    assert waited(fast_async, range(SLOW_STEPS - 1)) < 0.3 * waited(sync, range(SLOW_STEPS - 1)), waits(fast_async)
    assert steps_ahead(*results["async"]) >= 1.5, steps_ahead(*results["async"])
    assert steps_ahead(*results["local"]) < 1.3 and steps_ahead(*results["sync"]) < 1.3
    fast, slow = results["async"]
    assert max(fast["staleness"]) >= 2 and max(slow["staleness"]) == 0, (fast["staleness"], slow["staleness"])
    assert "replica 0 staleness: max" in fast["report"]
    # both end on the weights after every replica's last round, which stale rounds made other than local's
    assert weight_diff(fast["weights"], slow["weights"]) == 0.0
    assert weight_diff(fast["weights"], results["local"][0]["weights"]) > 1e-4
    bounded = results["bounded"]
    assert max(bounded[0]["staleness"]) <= 1 and steps_ahead(*bounded) < steps_ahead(*results["async"])
