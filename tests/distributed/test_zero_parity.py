"""ZeRO 0-3 over 2 data-parallel ranks against a single-process PyTorch loop on the same global batches.

Every run of 2 ranks is one launch (``two_ranks``), every run of one process another (``one_rank``): each builds its
own Trainer in turn."""

import lightning as L
import pytest
from helpers import OPTIM, TINY, SaveAtStep, assert_bf16_curve, assert_parity, datamodule, fit, in_turn, max_abs_diff
from helpers import reference

from lightning_mgpu import LLMModule
from lightning_mgpu.testing import run_distributed


class DoubledGradients(LLMModule):
    """The bug of summing gradients over two replicas instead of averaging them: every gradient comes out 2x."""

    def on_fit_start(self) -> None:  # the parameters the engine trains (configure_model builds them on meta)
        for p in self.model.parameters():
            p.register_hook(lambda grad: 2 * grad)


class OverlapOn(L.Callback):
    def on_train_start(self, trainer, *args):
        assert trainer.strategy.model.zero_overlap_comm() is True  # the engine really runs overlapped


OVERLAP = {"zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
           "pp2_zero2": dict(zero_stage=2, pipeline_parallel_size=2, pipeline_schedule="gpipe")}
OFFLOAD = {"offload0": dict(zero_stage=2, offload_optimizer="cpu"),
           "offload1": dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")}


def registered_name(rank, token_file):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_zero2", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(LLMModule(TINY, **OPTIM), datamodule(token_file))
    return type(trainer.strategy).__name__, trainer.strategy.layout.zero_stage, trainer.global_step


def overlapped(devices: int, token_file, **kw) -> tuple:
    return (fit, (token_file, devices), dict(callbacks=[OverlapOn()],
                                             deepspeed_config={"zero_optimization": {"overlap_comm": True}}, **kw))


@pytest.fixture(scope="module")
def two_ranks(token_file, tmp_path_factory):
    """Every run of this file on 2 ranks, in one launch: name -> each rank's result."""
    ckpt = str(tmp_path_factory.mktemp("zero_parity") / "ckpt")
    accumulated = dict(OPTIM, max_steps=5)
    calls = {f"zero{stage}": (fit, (token_file, 2), dict(zero_stage=stage)) for stage in range(4)}
    calls["doubled"] = (fit, (token_file, 2), dict(zero_stage=2, module=DoubledGradients(TINY, **OPTIM,
                                                                                         global_batch_size=8)))
    calls.update({name: (fit, (token_file, 2), kw) for name, kw in OFFLOAD.items()})
    calls.update({f"overlap_{name}": overlapped(2, token_file, **kw) for name, kw in OVERLAP.items()
                  if "pipeline_parallel_size" not in kw})
    calls["bf16"] = (fit, (token_file, 2), dict(zero_stage=2, precision="bf16-mixed"))
    calls["whole3"] = (fit, (token_file, 2), dict(max_steps=6, callbacks=[SaveAtStep(3, ckpt)], zero_stage=3))
    calls["resumed3"] = (fit, (token_file, 2), dict(max_steps=6, ckpt_path=ckpt, zero_stage=3))
    calls["registered"] = (registered_name, (token_file,), {})
    calls.update({f"accumulate{stage}": (fit, (token_file, 2), dict(
        max_steps=5, zero_stage=stage, accumulate=2, module=LLMModule(TINY, **accumulated, global_batch_size=8)))
        for stage in (1, 3)})
    results = run_distributed(in_turn, 2, calls)
    return {name: [r[name] for r in results] for name in calls}


@pytest.fixture(scope="module")
def one_rank(token_file):
    """Every run of this file on one process, in one launch: name -> its result."""
    calls = {"zero0": (fit, (token_file, 1), dict(zero_stage=0)),
             "epochs": (fit, (token_file, 1), dict(max_steps=7, trainer_kw=dict(limit_train_batches=3),
                                                   module=LLMModule(TINY, **dict(OPTIM, max_steps=7),
                                                                    global_batch_size=8)))}
    return run_distributed(in_turn, 1, calls)[0]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_zero_matches_single_process(two_ranks, ref, zero_stage):
    results = two_ranks[f"zero{zero_stage}"]
    assert_parity(results, ref)  # every rank reports the global-batch loss and the global grad norm
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # the run learns, so the comparison means something


def test_parity_check_catches_a_doubled_gradient(two_ranks, ref):
    results = two_ranks["doubled"]
    # Clipping (0.3) and AdamW hide the scale from the loss, so only the grad norm can tell.
    assert max_abs_diff(results[0]["losses"], ref["losses"]) < 1e-5
    with pytest.raises(AssertionError, match="grad_norm differs"):
        assert_parity(results, ref)


@pytest.mark.parametrize("offload", OFFLOAD)
def test_cpu_offload_matches_single_process(two_ranks, ref, offload):
    result = two_ranks[offload][0]
    assert max_abs_diff(result["losses"], ref["losses"]) < 1e-5
    assert max_abs_diff(result["grad_norms"], ref["grad_norms"]) < 1e-5


@pytest.mark.parametrize("name", OVERLAP)
def test_overlapped_communication_matches_single_process(two_ranks, token_file, ref, name):
    """The configuration CUDA runs by default (``overlap_comm``: gradient buckets reduced, and ZeRO-3 parameters
    gathered, on side streams during compute), forced on CPU: the same losses and grad norms as one process."""
    if "pipeline_parallel_size" in OVERLAP[name]:  # 4 ranks: a launch of its own
        results = run_distributed(in_turn, 4, {name: overlapped(4, token_file, **OVERLAP[name])})
        results = [r[name] for r in results]
    else:
        results = two_ranks[f"overlap_{name}"]
    assert_parity(results, ref)


def test_single_process_strategy_matches_reference(one_rank, ref):
    assert_parity([one_rank["zero0"]], ref)


def test_bf16_mixed_follows_fp32(two_ranks, ref):
    assert_bf16_curve(two_ranks["bf16"], ref)


@pytest.mark.parametrize("zero_stage", [3])  # ZeRO-2: tests/distributed/test_tensor_parallel.py (tp2 x dp2)
def test_save_resume_is_bit_identical(two_ranks, zero_stage):
    whole, resumed = two_ranks[f"whole{zero_stage}"][0]["losses"], two_ranks[f"resumed{zero_stage}"][0]["losses"]
    assert resumed == whole[3:]  # exact: same batches, same optimizer state, same LR schedule position


def test_registered_strategy_name_trains(two_ranks):
    assert two_ranks["registered"] == [("MGPUStrategy", 2, 2)] * 2


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_accumulate_grad_batches_over_global_batches_of_micro_batches(two_ranks, token_file, zero_stage):
    """Trainer(accumulate_grad_batches=2) with the data module's micro-batches: one optimizer step per 2 global
    batches of 2 micro-batches per rank, i.e. the engine accumulates 2 x 2 backward passes per rank."""
    expected = reference(token_file, steps=5, accumulate=2, optim=dict(OPTIM, max_steps=5))
    results = two_ranks[f"accumulate{zero_stage}"]
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5  # per global batch: 10
        assert max_abs_diff(r["grad_norms"][1::2], expected["grad_norms"]) < 1e-5  # per optimizer step: 5


def test_epochs_continue_the_batch_stream(one_rank, token_file):
    """With epochs of 3 batches (limit_train_batches), each epoch draws the next global batches, not the first
    ones again: 7 steps over three epochs equal 7 steps of one stream."""
    expected = reference(token_file, steps=7, optim=dict(OPTIM, max_steps=7))
    assert_parity([one_rank["epochs"]], expected)
