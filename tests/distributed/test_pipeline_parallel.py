"""Pipeline parallelism with every schedule, alone and with tensor parallelism and ZeRO, against one process."""

from dataclasses import replace

import lightning as L

import pytest
from helpers import (GLOBAL_BATCH, MICRO_BATCH, OPTIM, TINY, SaveAtStep, assert_bf16_curve, assert_parity, fit, in_turn,
                     reference)

from lightning_mgpu import LLMModule
from lightning_mgpu.layout import V_SCHEDULES, theoretical_bubble
from lightning_mgpu.parallel.timeline import bubble_fraction, chunks_in_flight, plot_timeline
from lightning_mgpu.planner.memory import in_flight_chunks
from lightning_mgpu.testing import run_distributed

DEEP = replace(TINY, n_layers=8)  # enough blocks for 8 stages (pp=4 x 2 virtual)
STEPS = 4  # as tests/helpers.py: warm-up and the start of the decay


@pytest.fixture(scope="module")
def ref(token_file):
    return reference(token_file, steps=STEPS, clip=0.3, model=DEEP)


def run(token_file, ranks, model=DEEP, **kw):
    return run_distributed(fit, ranks, token_file, ranks, max_steps=STEPS, model=model, **kw)


def virtual(schedule):
    return 1 if schedule in ("gpipe", "1f1b") else 2


SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
                    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


class ScheduleProbe(L.Callback):
    """The class of the schedule the strategy built."""

    def __init__(self) -> None:
        self.name = None

    def on_train_start(self, trainer, module) -> None:
        self.name = type(trainer.strategy.pipeline.schedule).__name__


def fit_with_schedule(rank, token_file, devices, **kw):
    probe = ScheduleProbe()
    return {**fit(rank, token_file, devices, callbacks=[probe], **kw), "schedule": probe.name}


@pytest.fixture(scope="module")
def ref_validated(token_file):
    return reference(token_file, steps=STEPS, clip=0.3, model=replace(TINY, n_layers=4), val_batches=1)


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_every_schedule_trains_and_validates_at_parity(token_file, ref_validated, schedule):
    """pp2 with ZeRO-1 under each of the seven schedules: per-step loss and grad norm, and the validation loss after
    the last step, equal one process; the schedule that ran is the one asked for (mgpu-train runs two of them in
    tests/cli/test_cli.py)."""
    results = run_distributed(fit_with_schedule, 2, token_file, 2, max_steps=STEPS, model=replace(TINY, n_layers=4),
                              validate=True, pipeline_parallel_size=2, zero_stage=1, pipeline_schedule=schedule,
                              virtual_pipeline_size=virtual(schedule))
    assert_parity(results, ref_validated)
    for r in results:
        assert r["schedule"] == SCHEDULE_CLASSES[schedule]
        assert abs(r["val_loss"] - ref_validated["val_loss"]) < 1e-5




@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pp4_matches_single_process(token_file, ref, schedule):
    """Parity, and the activations each rank held in flight are the planner's count for that rank
    (``planner.memory.in_flight_chunks``; 4 micro-batches: 1F1B 4, 3, 2, 1; interleaved 8, 8, 7, 5 chunks)."""
    V = virtual(schedule)
    results = run(token_file, 4, pipeline_parallel_size=4, pipeline_schedule=schedule, virtual_pipeline_size=V,
                  pipeline_timeline=True)
    assert_parity(results, ref)
    M = GLOBAL_BATCH // MICRO_BATCH
    measured = [chunks_in_flight(r["timeline"]) for r in results]
    assert measured == [in_flight_chunks(schedule, 4, V, rank, M) for rank in range(4)], measured


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_pp2_dp2_zero_matches_single_process(token_file, ref, zero_stage):
    results = run(token_file, 4, pipeline_parallel_size=2, zero_stage=zero_stage)
    assert_parity(results, ref)


def test_pp2_tp2_with_sequence_parallel_and_selective_recomputation_matches_single_process(token_file, ref):
    """Selective recomputation (projection outputs kept, the tensor-parallel collectives and attention recomputed),
    applied by ``parallelize`` to this rank's blocks after the stage split, gives the plain run's losses and grad
    norms: ``ref`` recomputes nothing. (The same layout without recomputation adds nothing this test and the 3D one
    below do not cover.)"""
    class Checkpointed(L.Callback):
        def on_train_start(self, trainer, *args):
            blocks = trainer.lightning_module.checkpointed_blocks()[1]
            assert blocks and all(getattr(b, "activation_checkpointing", None) == "selective" for b in blocks)

    results = run(token_file, 4, model=replace(DEEP, activation_checkpointing="selective"), pipeline_parallel_size=2,
                  tensor_parallel_size=2, sequence_parallel=True, pipeline_schedule="interleaved_1f1b",
                  virtual_pipeline_size=2, callbacks=[Checkpointed()])
    assert_parity(results, ref)


class ListBatches(LLMModule):
    """An LLMModule whose batches arrive as a one-element list, as a ``TensorDataset``'s loader yields them."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return [batch]


def test_3d_pp2_tp2_dp2_zero1_matches_single_process_with_bare_or_listed_batches(token_file, ref):
    """pp2 x tp2 x dp2 with ZeRO-1, and in the same launch the same run with each batch in a list (what the stages
    need read from the loader's container): both equal one process."""
    kw = dict(max_steps=STEPS, model=DEEP, pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=1)
    calls = {"bare": (fit, (token_file, 8), kw),
             "listed": (fit, (token_file, 8), dict(module=ListBatches(DEEP, **OPTIM, global_batch_size=GLOBAL_BATCH),
                                                   **kw))}
    results = run_distributed(in_turn, 8, calls)
    assert_parity([r["bare"] for r in results], ref)
    assert_parity([r["listed"] for r in results], ref)


def test_explicit_boundaries_give_the_same_function(token_file, ref):
    results = run(token_file, 2, pipeline_parallel_size=2, pipeline_boundaries=[0, 2, 8])
    assert_parity(results, ref)


def test_validation_runs_the_pipeline_forward_only(token_file):
    kw = dict(max_steps=3, model=DEEP, validate=True)
    split = run_distributed(fit, 2, token_file, 2, pipeline_parallel_size=2, **kw)
    whole = run_distributed(fit, 1, token_file, 1, **kw)[0]
    for r in split:
        assert r["losses"] == pytest.approx(whole["losses"], abs=1e-5)  # and training went on after validation
        assert abs(r["val_loss"] - whole["val_loss"]) < 1e-5


# The universal format at pp2 resumes in tests/distributed/test_resharding.py (pp2 1F1B -> pp2 interleaved ...).
@pytest.mark.parametrize("checkpoint_format", ["deepspeed"])
def test_save_resume_pp2_dp2_is_bit_identical(token_file, tmp_path, checkpoint_format):
    kw = dict(pipeline_parallel_size=2, zero_stage=2, checkpoint_format=checkpoint_format,
              trust_deepspeed_checkpoints=checkpoint_format == "deepspeed")
    ckpt = tmp_path / "ckpt"
    whole = run_distributed(fit, 4, token_file, 4, max_steps=6, model=DEEP, callbacks=[SaveAtStep(3, str(ckpt))],
                            **kw)[0]["losses"]
    if checkpoint_format == "deepspeed":  # DeepSpeed names files by tp rank only: one directory per pipeline rank
        assert sorted(p.name for p in ckpt.iterdir()) == ["checksums.json", "pipeline_rank_000", "pipeline_rank_001"]
    resumed = run_distributed(fit, 4, token_file, 4, max_steps=6, model=DEEP, ckpt_path=str(ckpt), **kw)[0]["losses"]
    assert resumed == whole[3:]


def test_timeline_records_every_action_and_draws_a_gantt_chart(token_file, tmp_path):
    results = run(token_file, 2, pipeline_parallel_size=2, pipeline_timeline=True)
    last = STEPS - 1
    per_rank = [[a for a in r["timeline"] if a.step == last] for r in results]
    for rank, actions in enumerate(per_rank):  # 4 micro-batches: a forward and a backward each, on this rank's stage
        assert sorted((a.kind, a.microbatch) for a in actions) == sorted((k, m) for k in "FB" for m in range(4))
        assert {a.stage for a in actions} == {rank}
    first_backward = min(a.start for a in per_rank[1] if a.kind == "B")
    assert max(a.end for a in per_rank[0] if a.kind == "F" and a.microbatch == 0) <= first_backward
    bubble = bubble_fraction(per_rank)
    assert 0.0 < bubble < 1.0
    png = plot_timeline(per_rank, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_theoretical_bubbles():
    assert theoretical_bubble("1f1b", P=4, M=8) == pytest.approx(3 / 11)
    assert theoretical_bubble("gpipe", P=2, M=4) == pytest.approx(1 / 5)
    assert theoretical_bubble("interleaved_1f1b", P=4, M=8, V=2) == pytest.approx(3 / 19)
    for schedule in V_SCHEDULES:  # always two stages per rank
        assert theoretical_bubble(schedule, P=2, M=4, V=1) == pytest.approx(1 / 25)


def test_pp2_bf16_mixed_follows_fp32(token_file, ref):
    assert_bf16_curve(run(token_file, 2, pipeline_parallel_size=2, zero_stage=1, precision="bf16-mixed"), ref)


class ManualLLMModule(LLMModule):
    """An LLMModule that asks for manual optimization (which a pipeline schedule cannot give it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def _refusal(rank, token_file, **kw):
    try:
        fit(rank, token_file, 2, max_steps=1, model=DEEP, **kw)
    except ValueError as err:
        return str(err)
    return "trained"


def test_pipeline_refuses_accumulation_and_manual_optimization(token_file):
    accumulate = run_distributed(_refusal, 2, token_file, pipeline_parallel_size=2, accumulate=2)[0]
    assert "accumulate_grad_batches=2 is not supported with pipeline parallelism" in accumulate
    # (Lightning itself refuses clipping and accumulation with manual optimization, so neither is asked for here)
    manual = run_distributed(_refusal, 2, token_file, pipeline_parallel_size=2, clip=None,
                             module=ManualLLMModule(DEEP, **OPTIM, global_batch_size=8))[0]
    assert "manual optimization (automatic_optimization=False) is not supported with pipeline" in manual
    assert "manual optimization runs one training_step per batch, but 4 micro-batches" in manual  # listed together
