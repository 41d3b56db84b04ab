"""ZeRO 0-3 over 2 data-parallel ranks against a single-process PyTorch loop on the same global batches."""

import pytest
from helpers import OPTIM, TINY, SaveAtStep, assert_bf16_curve, assert_parity, fit, max_abs_diff, reference

from lightning_mgpu import LLMModule

from lightning_mgpu.testing import run_distributed



@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_zero_matches_single_process(token_file, ref, zero_stage):
    results = run_distributed(fit, 2, token_file, 2, zero_stage=zero_stage)
    assert_parity(results, ref)  # every rank reports the global-batch loss and the global grad norm
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # the run learns, so the comparison means something


class DoubledGradients(LLMModule):
    """The bug of summing gradients over two replicas instead of averaging them: every gradient comes out 2x."""

    def on_fit_start(self) -> None:  # the parameters the engine trains (configure_model builds them on meta)
        for p in self.model.parameters():
            p.register_hook(lambda grad: 2 * grad)


def test_parity_check_catches_a_doubled_gradient(token_file, ref):
    results = run_distributed(fit, 2, token_file, 2, zero_stage=2, module=DoubledGradients(TINY, **OPTIM,
                                                                                           global_batch_size=8))
    # Clipping (0.3) and AdamW hide the scale from the loss, so only the grad norm can tell.
    assert max_abs_diff(results[0]["losses"], ref["losses"]) < 1e-5
    with pytest.raises(AssertionError, match="grad_norm differs"):
        assert_parity(results, ref)


@pytest.mark.parametrize("offload", [dict(zero_stage=2, offload_optimizer="cpu"),
                                     dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")])
def test_cpu_offload_matches_single_process(token_file, ref, offload):
    result = run_distributed(fit, 2, token_file, 2, **offload)[0]
    assert max_abs_diff(result["losses"], ref["losses"]) < 1e-5
    assert max_abs_diff(result["grad_norms"], ref["grad_norms"]) < 1e-5


@pytest.mark.parametrize("kw", [dict(zero_stage=2), dict(zero_stage=3),
                                dict(zero_stage=2, pipeline_parallel_size=2, pipeline_schedule="gpipe")],
                         ids=["zero2", "zero3", "pp2_zero2"])
def test_overlapped_communication_matches_single_process(token_file, ref, kw):
    """The configuration CUDA runs by default (``overlap_comm``: gradient buckets reduced, and ZeRO-3 parameters
    gathered, on side streams during compute), forced on CPU: the same losses and grad norms as one process."""
    import lightning as L

    class OverlapOn(L.Callback):
        def on_train_start(self, trainer, *args):
            assert trainer.strategy.model.zero_overlap_comm() is True  # the engine really runs overlapped

    devices = 2 * kw.get("pipeline_parallel_size", 1)
    results = run_distributed(fit, devices, token_file, devices, callbacks=[OverlapOn()],
                              deepspeed_config={"zero_optimization": {"overlap_comm": True}}, **kw)
    assert_parity(results, ref)


def test_single_process_strategy_matches_reference(token_file, ref):
    assert_parity(run_distributed(fit, 1, token_file, 1, zero_stage=0), ref)


def test_bf16_mixed_follows_fp32(token_file, ref):
    assert_bf16_curve(run_distributed(fit, 2, token_file, 2, zero_stage=2, precision="bf16-mixed"), ref)


@pytest.mark.parametrize("zero_stage", [3])  # ZeRO-2: tests/distributed/test_tensor_parallel.py (tp2 x dp2)
def test_save_resume_is_bit_identical(token_file, tmp_path, zero_stage):
    ckpt = str(tmp_path / "ckpt")
    whole = run_distributed(fit, 2, token_file, 2, max_steps=6, callbacks=[SaveAtStep(3, ckpt)],
                            zero_stage=zero_stage)[0]["losses"]
    resumed = run_distributed(fit, 2, token_file, 2, max_steps=6, ckpt_path=ckpt, zero_stage=zero_stage)[0]["losses"]
    assert resumed == whole[3:]  # exact: same batches, same optimizer state, same LR schedule position


def test_registered_strategy_name_trains(token_file):
    import lightning as L
    from helpers import OPTIM, TINY, datamodule

    from lightning_mgpu import LLMModule

    def run(rank):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_zero2", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
        trainer.fit(LLMModule(TINY, **OPTIM), datamodule(token_file))
        return type(trainer.strategy).__name__, trainer.strategy.layout.zero_stage, trainer.global_step

    assert run_distributed(run, 2) == [("MGPUStrategy", 2, 2)] * 2


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_accumulate_grad_batches_over_global_batches_of_micro_batches(token_file, zero_stage):
    """Trainer(accumulate_grad_batches=2) with the data module's micro-batches: one optimizer step per 2 global
    batches of 2 micro-batches per rank, i.e. the engine accumulates 2 x 2 backward passes per rank."""
    expected = reference(token_file, steps=5, accumulate=2, optim=dict(OPTIM, max_steps=5))
    results = run_distributed(fit, 2, token_file, 2, max_steps=5, zero_stage=zero_stage, accumulate=2,
                              module=LLMModule(TINY, **dict(OPTIM, max_steps=5), global_batch_size=8))
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5  # per global batch: 10
        assert max_abs_diff(r["grad_norms"][1::2], expected["grad_norms"]) < 1e-5  # per optimizer step: 5


def test_epochs_continue_the_batch_stream(token_file):
    """With epochs of 3 batches (limit_train_batches), each epoch draws the next global batches, not the first
    ones again: 7 steps over three epochs equal 7 steps of one stream."""
    expected = reference(token_file, steps=7, optim=dict(OPTIM, max_steps=7))
    (result,) = run_distributed(fit, 1, token_file, 1, max_steps=7, trainer_kw=dict(limit_train_batches=3),
                                module=LLMModule(TINY, **dict(OPTIM, max_steps=7), global_batch_size=8))
    assert_parity([result], expected)
