"""A signal to one rank, at any moment of a step: every rank stops at the next step boundary with an emergency
checkpoint, and the resumed run ends with the uninterrupted run's weights, bit for bit."""

import os

import pytest
from helpers import in_turn
from test_replicas import fit_weights, weight_diff

from lightning_mgpu.callbacks import PeriodicCheckpoint
from lightning_mgpu.resilience.preemption import Preemption
from lightning_mgpu.resilience.faults import fault_callbacks
from lightning_mgpu.testing import run_distributed

STEPS = 6


def preemptible_fit(rank: int, token_file, directory, environ: dict, requeue=None, **kw) -> dict:
    """2 ZeRO-1 ranks with a checkpoint directory (periodic saves too rare to matter) and preemption handling; the
    fault injection of ``environ`` (``MGPU_SIGNAL_RANK_AT`` ...)."""
    import signal

    os.environ.update(environ)
    checkpoint = PeriodicCheckpoint(directory, every_n_steps=100)
    preemption = Preemption(checkpoint, requeue=requeue)
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)]
    try:
        out = fit_weights(rank, token_file, 2, max_steps_=STEPS, zero_stage=1,
                          callbacks=(checkpoint, preemption, *fault_callbacks()), **kw)
    finally:  # a run after this one in the same rank injects only its own faults
        for key in environ:
            os.environ.pop(key)
    restored = before == [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)]
    return {**out, "preempted": preemption.preempted, "handlers_restored": restored,
            "received": signal.Signals(preemption.received).name if preemption.received else None}


def stop_and_resume(directory, environ: dict, **kw) -> dict:
    """The calls of a run stopped by ``environ``'s signal into ``directory``, then of its resume from there."""
    return {"stopped": (preemptible_fit, (directory, environ), kw),
            "resumed": (preemptible_fit, (directory, {}), dict(kw, ckpt_path=str(directory)))}


@pytest.fixture(scope="module")
def runs(token_file, tmp_path_factory):
    """Every run of the signal tests of 2 ranks, in one launch, one after the other (a fresh Trainer each): the
    uninterrupted run, each signal's stopped and resumed runs, the accumulating ones, the signal in the last step.
    Name -> each rank's result, and the directories they wrote."""
    root = tmp_path_factory.mktemp("preemption")
    calls = {"whole": (preemptible_fit, (root / "whole", {}), {})}
    for name in SIGNALS:
        parts = stop_and_resume(root / name, {"MGPU_SIGNAL_RANK_AT": "1:3", "MGPU_SIGNAL": name})
        calls[f"{name}_stopped"] = parts["stopped"]
        calls[f"{name}_listed"] = (listed, (root / name,), {})
        calls[f"{name}_resumed"] = parts["resumed"]
    calls["accumulate_whole"] = (preemptible_fit, (root / "accumulate_whole", {}), dict(accumulate=2))
    parts = stop_and_resume(root / "accumulate", {"MGPU_SIGNAL_RANK_AT": "1:0"}, accumulate=2)
    calls.update({f"accumulate_{part}": call for part, call in parts.items()})
    calls["last_step"] = (preemptible_fit, (root / "last_step", {"MGPU_SIGNAL_RANK_AT": f"1:{STEPS - 1}"}), {})
    calls = {name: (fn, (token_file, *args) if fn is preemptible_fit else args, kw)
             for name, (fn, args, kw) in calls.items()}
    results = run_distributed(in_turn, 2, calls)
    return dict({name: [r[name] for r in results] for name in calls}, root=root)


SIGNALS = ["SIGTERM", "SIGUSR1"]


def listed(rank: int, directory) -> list[str]:
    """What ``directory`` holds once every rank has ended the run before."""
    import torch.distributed as dist

    dist.barrier()
    return sorted(p.name for p in directory.iterdir())


def test_the_signal_handlers_before_fit_are_back_after_it(runs):
    assert all(r["handlers_restored"] for r in runs["whole"])


@pytest.mark.parametrize("name", SIGNALS)
def test_a_signal_to_one_rank_stops_every_rank_and_loses_no_step(runs, name):
    """The signal reaches rank 1 inside the backward pass of step 4 (global step 3): both ranks finish that step,
    agree, save ``step-00000004`` and stop; resumed from the directory, the run ends where the uninterrupted one
    ends, bit for bit."""
    stopped, resumed = runs[f"{name}_stopped"], runs[f"{name}_resumed"]
    for r in stopped:
        assert r["preempted"] is not None and (r["preempted"].signal, r["preempted"].rank) == (name, 1)
        assert r["preempted"].step == 4 and len(r["losses"]) == 4
    assert runs[f"{name}_listed"][0] == ["step-00000004"]
    for whole, again in zip(runs["whole"], resumed):
        assert again["losses"] == whole["losses"][4:] and again["preempted"] is None
        assert weight_diff(whole["weights"], again["weights"]) == 0.0


def test_with_gradient_accumulation_the_stop_waits_for_the_optimizer_step(runs):
    """2 batches per optimizer step: a signal in the first batch of step 1 stops every rank after that step (not
    between its two batches), and the resumed run ends on the uninterrupted run's weights."""
    whole, stopped, resumed = runs["accumulate_whole"], runs["accumulate_stopped"], runs["accumulate_resumed"]
    assert [r["preempted"].step for r in stopped] == [1, 1]
    for w, again in zip(whole, resumed):
        assert weight_diff(w["weights"], again["weights"]) == 0.0


def test_a_signal_in_the_last_step_lets_the_run_end_as_planned(runs):
    """SIGUSR2 (whose default action ends the process) reaches rank 1 in the last step: the callback's handler
    catches it, and the run ends as planned, with no emergency checkpoint."""
    ended, directory = runs["last_step"], runs["root"] / "last_step"
    assert [r["received"] for r in ended] == [None, "SIGUSR2"]  # the signal came, and this handler took it
    assert all(r["preempted"] is None and len(r["losses"]) == STEPS for r in ended)
    assert not directory.exists() or not list(directory.iterdir())  # no emergency checkpoint


def test_under_slurm_rank_0_requeues_the_job_once(token_file, tmp_path, monkeypatch):
    """A stand-in ``scontrol`` on the PATH records its calls: one ``requeue 4242``, after the checkpoint."""
    from lightning_mgpu.resilience.preemption import slurm_requeue_command

    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nls {tmp_path / 'ckpt'} >> {calls}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    requeue = slurm_requeue_command({"SLURM_JOB_ID": "4242"})
    run_distributed(preemptible_fit, 2, token_file, tmp_path / "ckpt", {"MGPU_SIGNAL_RANK_AT": "0:2"},
                    requeue=requeue)
    assert calls.read_text().splitlines() == ["requeue 4242", "step-00000003"]
