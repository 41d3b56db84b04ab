"""GPU-only checks: run on a lent accelerator; skipped without CUDA."""

import lightning as L
import pytest
import torch
from helpers import OPTIM, TINY, datamodule

from lightning_mgpu import LLMModule, MGPUStrategy


@pytest.mark.gpu
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_bf16_training_on_one_gpu_with_nccl(token_file, zero_stage):
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=zero_stage),
                        precision="bf16-mixed", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0)
    module = LLMModule(TINY, **OPTIM)
    trainer.fit(module, datamodule(token_file))
    assert torch.distributed.get_backend() == "nccl"
    assert next(trainer.strategy.model.parameters()).is_cuda
    assert trainer.strategy.model.zero_overlap_comm() is (zero_stage >= 2)  # overlap is on by default on CUDA
    assert trainer.global_step == 5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_parallel_attention_of_a_late_chunk_matches_whole_causal_attention_on_cuda(dtype):
    """The CUDA branch of the context-parallel kernel (torch's lower-right causal mask, key/value heads expanded):
    the last query chunk attending to all keys equals the last rows of causal attention over the whole sequence."""
    import torch.nn.functional as F

    from lightning_mgpu.parallel.context import ContextParallelAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 256, 64, generator=g) for heads in (8, 2, 2))
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    kernel = ContextParallelAttention(group=None, rank=0, size=2)
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q[:, :, 192:], k, v)]
    late = kernel.attend(*inputs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(late.float().cpu(), whole[:, :, 192:], atol=tol, rtol=tol)
    # and the gradients: of the late queries, and of every key and value they see
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(4, 1) for t in leaves[1:]),
                                               is_causal=True)[:, :, 192:]
    reference.sum().backward()
    late.sum().backward()
    for got, want in zip(inputs, (leaves[0].grad[:, :, 192:], leaves[1].grad, leaves[2].grad)):
        torch.testing.assert_close(got.grad.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_a_profiled_step_on_one_gpu_writes_its_kernels_and_the_allocator_snapshot(token_file, tmp_path):
    """profile.steps on CUDA: the trace holds the step's CUDA kernels, the memory file the allocator's peaks, and the
    snapshot (what pytorch.org/memory_viz opens) the step's allocations."""
    import json
    import pickle

    from lightning_mgpu.callbacks.profile import ProfileSteps

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=2), precision="bf16-mixed",
                        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, callbacks=[ProfileSteps([1], tmp_path)])
    trainer.fit(LLMModule(TINY, **OPTIM), datamodule(token_file))
    step = tmp_path / "step1"
    assert sorted(p.name for p in step.iterdir()) == ["rank0.memory.json", "rank0.memory.pickle", "rank0.trace.json"]
    trace = json.loads((step / "rank0.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in trace)  # CUDA activity, not only the CPU's
    memory = json.loads((step / "rank0.memory.json").read_text())
    assert memory["cuda"]["max_allocated_bytes"] > 0 and memory["cuda"]["snapshot"] == "rank0.memory.pickle"
    assert any(t["device"].startswith("cuda") for t in memory["largest_tensors"])
    snapshot = pickle.loads((step / "rank0.memory.pickle").read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])  # the step's allocations


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_on_cuda_runs_fp8_gemms_and_equals_torchaos_float8_linear(recipe):
    """On CUDA the package's fp8 linear runs torchao's fp8 GEMMs (``torch._scaled_mm``, three per layer: output,
    input gradient, weight gradient), not the emulation, and equals torchao's own ``Float8Linear`` (same recipe,
    power-of-two scales) in the output and both gradients."""
    import copy
    import dataclasses
    from unittest import mock

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_mgpu.fp8 import convert_to_fp8

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)).to("cuda", torch.bfloat16)
    theirs = copy.deepcopy(ours)
    convert_to_fp8(ours, recipe)
    convert_to_float8_training(theirs, config=dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                                                  round_scales_to_power_of_2=True))
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_()
        with mock.patch.object(torch, "_scaled_mm", wraps=torch._scaled_mm) as gemm:
            y = model(xi)
            y.float().square().sum().backward()
        assert gemm.call_count == 6, gemm.call_count
        results.append((y.detach(), xi.grad, model[0].weight.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_fp8_trains_on_one_gpu_and_refuses_sizes_the_kernels_cannot_take(token_file):
    """The tiny Llama (every size a multiple of 16) trains in bf16 with fp8 on one GPU; with a 72-wide MLP the strategy
    refuses at setup, naming each MLP layer and its sizes."""
    from dataclasses import replace

    from lightning_mgpu import MGPUPrecision

    def fit(config):
        trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, limit_val_batches=0,
                            strategy=MGPUStrategy(zero_stage=1,
                                                  precision_plugin=MGPUPrecision("bf16-mixed", fp8="rowwise")))
        trainer.fit(LLMModule(config, **OPTIM), datamodule(token_file))
        return trainer

    assert fit(TINY).global_step == 3
    if torch.distributed.is_initialized():  # the next fit starts its own one-process group
        torch.distributed.destroy_process_group()
    with pytest.raises(ValueError) as err:
        fit(replace(TINY, ffn_hidden=72))
    assert "fp8 layer model.layers.0.feed_forward.w1=(32, 72)" in str(err.value), str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_lora_step_in_bf16_on_one_gpu(zero_stage):
    """PEFT's LoRA over a tiny transformers Llama in bf16 on CUDA: the adapters move, the frozen base does not."""
    peft = pytest.importorskip("peft")
    from peft_helpers import AdaptedLM

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=zero_stage),
                        precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0)
    module = AdaptedLM("lora", "llama")
    before = {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
    trainer.fit(module)
    from lightning_mgpu.engine import gathered

    with gathered(list(module.parameters())):
        after = {n: p.detach().float().cpu() for n, p in module.named_parameters()}
    assert isinstance(module.llm, peft.PeftModel) and trainer.global_step == 3
    assert all(torch.equal(after[n], before[n].to(torch.bfloat16).float()) for n, p in module.named_parameters()
               if not p.requires_grad)
    assert any(not torch.equal(after[n], before[n]) for n, p in module.named_parameters() if p.requires_grad)
