"""A run of replicas stepping apart (``replica_update="local"``), checkpointed in the middle of a round: resumed, it
ends bit for bit where the uninterrupted run ends; resumed into another layout inside each replica, it ends where
that run ends to rounding; resumed with other replica settings, it is refused by name."""

import pytest
from test_replicas import DILOCO, fit_weights, replica_means, weight_diff

from helpers import max_abs_diff
from lightning_mgpu.callbacks import PeriodicCheckpoint
from lightning_mgpu.testing import run_distributed

LOCAL = dict(replicas=2, replica_update="local", sync_every=3, outer_optimizer=DILOCO)
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(token_file, tmp_path_factory):
    """6 steps of 2 replicas of 2 ZeRO-1 ranks, H=3, a checkpoint every 2 steps: step 2 and step 4 are each in the
    middle of a round (the outer steps come after steps 3 and 6)."""
    directory = tmp_path_factory.mktemp("replica_checkpoints")
    results = run_distributed(fit_weights, 4, token_file, 4, max_steps_=STEPS, zero_stage=1,
                              callbacks=(PeriodicCheckpoint(directory, 2, keep_last=3),), **LOCAL)
    return {"results": results, "dir": directory}


def test_a_round_resumes_bit_identically(token_file, uninterrupted):
    resumed = run_distributed(fit_weights, 4, token_file, 4, max_steps_=STEPS, zero_stage=1,
                              ckpt_path=str(uninterrupted["dir"] / "step-00000004"), **LOCAL)
    for whole, again in zip(uninterrupted["results"], resumed):
        assert weight_diff(whole["weights"], again["weights"]) == 0.0, whole["rank"]
        assert again["losses"] == whole["losses"][4:]  # steps 5 and 6: each replica's own batches and weights


@pytest.mark.parametrize("inside", [dict(zero_stage=3), dict(tensor_parallel_size=2, zero_stage=1)])
def test_a_round_reshards_inside_each_replica(token_file, uninterrupted, inside):
    """From step 2 into ZeRO-3 (2 ranks per replica) or tp2 (one tensor-parallel model per replica): each replica's
    own weights and moments and the outer weights and momentum are read into the new shards; the losses of steps 3-6
    (which cross both outer steps) are the uninterrupted run's."""
    resumed = run_distributed(fit_weights, 4, token_file, 4, max_steps_=STEPS,
                              ckpt_path=str(uninterrupted["dir"] / "step-00000002"), **inside, **LOCAL)
    assert max_abs_diff(replica_means(resumed, 2), replica_means(uninterrupted["results"], 2)[2:]) < 1e-5
    if "tensor_parallel_size" not in inside:
        assert weight_diff(resumed[0]["weights"], uninterrupted["results"][0]["weights"]) < 1e-5


@pytest.mark.parametrize("now", [dict(replicas=1, replica_update="sync"), dict(replicas=1, replica_update="local")])
def test_other_replica_settings_are_refused_by_name(token_file, uninterrupted, now):
    """Another update rule, or the same rule with another number of replicas."""
    with pytest.raises(Exception, match=rf"replicas=2, replica_update='local' and this run trains with replicas=1, "
                                        rf"replica_update='{now['replica_update']}'"):
        run_distributed(fit_weights, 4, token_file, 4, max_steps_=STEPS, zero_stage=1,
                        ckpt_path=str(uninterrupted["dir"] / "step-00000004"), **now)
