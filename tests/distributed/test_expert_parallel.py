"""Expert parallelism against one process: routes, losses and global gradient norms of a tiny mixture of experts at
ZeRO 0-3 and composed with tensor (+ sequence), context and pipeline parallelism, with the layout asserted."""

from dataclasses import replace

import lightning as L
import pytest
from helpers import GLOBAL_BATCH, OPTIM, assert_parity, fit
from moe_helpers import TINY_MOE, RouteRecorder, assert_routes_equal, moe_reference

from lightning_mgpu import LLMModule
from lightning_mgpu.testing import run_distributed

STEPS = 4
#: Four layers (the first dense) and bias balancing on, so pipeline stages split it and the bias moves.
DEEP_MOE = replace(TINY_MOE, n_layers=4, dense_layers=1, router_bias_rate=0.01)


@pytest.fixture(scope="module")
def moe_ref(token_file):
    return moe_reference(token_file, STEPS)


@pytest.fixture(scope="module")
def deep_ref(token_file):
    return moe_reference(token_file, STEPS, model=DEEP_MOE)


class Summary(L.Callback):
    """The recorder's summary, and the dtypes the experts and the router really held and computed in (the helper's
    probe sees the first attention linear only)."""

    def __init__(self, recorder: RouteRecorder) -> None:
        self.recorder, self.out = recorder, {"dtypes": {}}

    def on_train_start(self, trainer, module) -> None:
        dtypes = self.out["dtypes"]
        for layer in self.recorder.layers:
            dtypes["expert_weights"] = {str(p.dtype) for p in layer.experts.parameters()}
            dtypes["router_weight"] = str(layer.router.gate.weight.dtype)
            layer.experts.register_forward_hook(lambda m, a, out: dtypes.update(expert_output=str(out.dtype)))
            layer.router.gate.register_forward_hook(lambda m, a, out: dtypes.update(router_output=str(out.dtype)))

    def on_train_end(self, trainer, module) -> None:
        self.out.update(self.recorder.summary(trainer))


def fit_moe(rank, token_file, devices, model=TINY_MOE, **strategy):
    recorder = RouteRecorder()
    summary = Summary(recorder)
    result = fit(rank, token_file, devices, max_steps=STEPS, callbacks=[recorder, summary], check_layout=False,
                 module=LLMModule(model, **OPTIM, global_batch_size=GLOBAL_BATCH), **strategy)
    return {**result, **summary.out}


def assert_experts_split(results, Ep, T=1, E=4, hidden=64, model=TINY_MOE):
    """Each rank holds E / Ep experts of every MoE layer (hidden / T of each), the ones at its place in its group;
    each counts the whole model's parameters (the model summary's total) as the config's formula does."""
    for r in results:
        assert r["whole_parameters"] == model.num_parameters(), (r["whole_parameters"], model.num_parameters())
        for name, shape in r["held"].items():
            assert shape[0] == E // Ep and shape[2 if name.endswith(("w1", "w3")) else 1] == hidden // T, (name, shape)
        if Ep > 1:
            ep = r["groups"]["ep"]
            assert len(ep) == Ep and r["first_expert"] == {ep.index(r["rank"]) * E // Ep}


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_expert_parallel_matches_single_process(token_file, moe_ref, zero_stage):
    """Four data-parallel ranks, two expert-parallel groups: each expert's gradient is reduced, and ZeRO partitions
    it, over the two ranks that hold it (ranks 0 and 2 hold experts 0-1)."""
    results = run_distributed(fit_moe, 4, token_file, 4, expert_parallel_size=2, zero_stage=zero_stage)
    assert_experts_split(results, Ep=2)
    assert results[0]["groups"] == {"ep": [0, 1], "edp": [0, 2]}
    assert_routes_equal(results, moe_ref)  # first: a flipped near-tie would explain any difference below
    assert_parity(results, moe_ref)
    assert moe_ref["losses"][-1] < moe_ref["losses"][0] - 0.1


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1),
                                dict(context_parallel_size=2, zero_stage=2),
                                # ZeRO-3 sums expert norms over the tensor x pipeline ranks only when told to
                                dict(tensor_parallel_size=2, zero_stage=3), dict(pipeline_parallel_size=2, zero_stage=3)],
                         ids=["tp2_sp", "cp2", "tp2_zero3", "pp2_zero3"])
def test_expert_parallel_composes_with_tensor_context_and_pipeline_parallel(token_file, moe_ref, kw):
    devices = 2 * kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1) * \
        kw.get("context_parallel_size", 1)  # cp2: over context and data ranks
    results = run_distributed(fit_moe, devices, token_file, devices, expert_parallel_size=2, **kw)
    assert_experts_split(results, Ep=2, T=kw.get("tensor_parallel_size", 1))
    assert_routes_equal(results, moe_ref)
    assert_parity(results, moe_ref)


#: One schedule of each kind the balancing losses could be lost in: a plain backward (1F1B), a backward split into
#: input and weight halves over virtual stages (interleaved zero bubble), and V-shaped stages whose forward and backward
#: overlap (DualPipeV). ``test_pipeline_parallel.py`` trains the dense model under all seven; GPipe, interleaved 1F1B,
#: looped BFS and ZBV add no kind of backward here (about 3.5 s of CPU each).
SCHEDULES = {"1f1b": {}, "interleaved_zero_bubble": dict(virtual_pipeline_size=2),
             "dualpipev": dict(virtual_pipeline_size=2)}


@pytest.fixture(scope="module")
def deep_ref_single(token_file):
    """The reference in chunks of one sequence: DualPipeV needs 4 micro-batches a rank, so micro-batches of 1."""
    return moe_reference(token_file, STEPS, model=DEEP_MOE, chunk=1)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_expert_parallel_under_each_kind_of_pipeline_schedule(token_file, deep_ref, deep_ref_single, schedule):
    """The balancing losses reach the routers of both stages under each kind of schedule (the grad norm sees their
    gradients; zero-bubble schedules split the backward) and the bias moves alike on every rank (the routes of later
    steps depend on it)."""
    single = schedule == "dualpipev"
    results = run_distributed(fit_moe, 4, token_file, 4, model=DEEP_MOE, expert_parallel_size=2,
                              pipeline_parallel_size=2, zero_stage=1, pipeline_schedule=schedule,
                              data=dict(micro_batch_size=1) if single else None, **SCHEDULES[schedule])
    assert_experts_split(results, Ep=2, model=DEEP_MOE)
    ref = deep_ref_single if single else deep_ref
    assert_routes_equal(results, ref)
    assert_parity(results, ref)


def dense_stage_segment(rank, token_file, devices, directory, max_steps, ckpt_path, **layout):
    """:func:`segment` of a 2-layer MoE whose first layer is dense, with what :func:`fit_moe` records."""
    from lightning_mgpu.callbacks import PeriodicCheckpoint

    recorder = RouteRecorder()
    summary = Summary(recorder)
    module = LLMModule(DENSE_FIRST, **OPTIM, global_batch_size=GLOBAL_BATCH)
    result = fit(rank, token_file, devices, max_steps=max_steps, ckpt_path=ckpt_path, module=module, check_layout=False,
                 callbacks=[recorder, summary, PeriodicCheckpoint(directory, every_n_steps=2, keep_last=1)], **layout)
    return {**result, **summary.out}


DENSE_FIRST = replace(TINY_MOE, dense_layers=1)


def test_a_pipeline_rank_without_experts_trains_beside_an_expert_placeholder(token_file, tmp_path):
    """Two layers, the first dense, at ep2 x pp2 under ZeRO-0 (the package's expert-aware global norm): pipeline rank 0
    holds no expert, and an expert placeholder so that its gradient-norm collectives meet rank 1's; its gradient is
    zero (the reference has none), the whole model's parameter count leaves it out, and so does the checkpoint, which
    resumes at ep1 on the same curve."""
    from lightning_mgpu.callbacks import newest_checkpoint

    ref = moe_reference(token_file, STEPS, model=DENSE_FIRST)
    first = run_distributed(dense_stage_segment, 4, token_file, 4, tmp_path, 2, None, expert_parallel_size=2,
                            pipeline_parallel_size=2, zero_stage=0)
    assert sorted(len(r["held"]) for r in first) == [0, 0, 3, 3]  # w1, w2, w3 of the one expert layer, or none
    assert {r["whole_parameters"] for r in first} == {DENSE_FIRST.num_parameters()}
    saved = newest_checkpoint(tmp_path)
    assert b"placeholder" not in (saved / ".metadata").read_bytes()  # neither its value nor its optimizer state
    second = run_distributed(dense_stage_segment, 2, token_file, 2, tmp_path, STEPS, str(saved), zero_stage=1)
    assert_parity(first, {k: v[:2] for k, v in ref.items() if k in ("losses", "grad_norms")})
    assert_parity(second, {k: v[2:] for k, v in ref.items() if k in ("losses", "grad_norms")})


def test_global_batch_balancing_statistics_span_the_data_parallel_ranks(token_file):
    """``aux_loss="global_batch"``: each micro-batch's statistics are summed over both data-parallel ranks, as one
    process computing them over the union of the two ranks' micro-batches (samples 0-1 with 4-5, 2-3 with 6-7)."""
    model = replace(TINY_MOE, aux_loss="global_batch", aux_loss_coeff=0.5)
    ref = moe_reference(token_file, STEPS, model=model, groups=[[0, 1, 4, 5], [2, 3, 6, 7]])
    per_rank = moe_reference(token_file, STEPS, model=model)  # statistics per rank instead: a different run
    assert abs(ref["grad_norms"][0] - per_rank["grad_norms"][0]) > 1e-4
    results = run_distributed(fit_moe, 2, token_file, 2, model=model, expert_parallel_size=2, zero_stage=1)
    assert_parity(results, ref)


def test_eight_processes_tensor_pipeline_data_and_expert_parallel(token_file, deep_ref):
    results = run_distributed(fit_moe, 8, token_file, 8, model=DEEP_MOE, expert_parallel_size=2,
                              tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=2, timeout=400)
    assert_experts_split(results, Ep=2, T=2, model=DEEP_MOE)
    assert results[0]["groups"] == {"ep": [0, 4], "edp": [0]}  # tp2 x pp2: the data-parallel peers of rank 0
    assert_routes_equal(results, deep_ref)
    assert_parity(results, deep_ref)


#: Each segment resumes the checkpoint the previous one wrote, on another expert-parallel size (and ZeRO stage).
CHAIN = [dict(devices=4, expert_parallel_size=2, zero_stage=2),  # each expert on two ranks: saved once
         dict(devices=2, expert_parallel_size=1, zero_stage=3),
         dict(devices=4, expert_parallel_size=4, zero_stage=1),
         dict(devices=4, expert_parallel_size=2, tensor_parallel_size=2, zero_stage=3),  # experts split by hidden too
         dict(devices=4, expert_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)]


def segment(rank, token_file, devices, directory, max_steps, ckpt_path, **layout):
    from lightning_mgpu.callbacks import PeriodicCheckpoint

    module = LLMModule(BIASED, **OPTIM, global_batch_size=GLOBAL_BATCH)
    return fit(rank, token_file, devices, max_steps=max_steps, ckpt_path=ckpt_path, module=module, check_layout=False,
               callbacks=[PeriodicCheckpoint(directory, every_n_steps=2, keep_last=1)], **layout)


BIASED = replace(TINY_MOE, router_bias_rate=0.01)


def test_universal_checkpoints_reshard_experts_2_1_4_and_other_axes(token_file, tmp_path):
    """Every segment continues the uninterrupted run: its losses and grad norms, and after it every expert's weights
    (read back from its checkpoint), each expert distinct from the others. The router bias is saved with them."""
    import torch

    from lightning_mgpu.callbacks import newest_checkpoint
    from lightning_mgpu.checkpoint.universal import read_model_weights

    ref = moe_reference(token_file, 2 * len(CHAIN), model=BIASED)
    for i, layout in enumerate(CHAIN):
        layout = dict(layout)
        devices = layout.pop("devices")
        resume = newest_checkpoint(tmp_path)
        results = run_distributed(segment, devices, token_file, devices, tmp_path, 2 * (i + 1),
                                  None if resume is None else str(resume), **layout)
        assert_parity(results, {k: ref_k[2 * i:2 * i + 2] for k, ref_k in
                                (("losses", ref["losses"]), ("grad_norms", ref["grad_norms"]))})
        _, weights = read_model_weights(newest_checkpoint(tmp_path))
        at_step = moe_reference(token_file, 2 * (i + 1), model=BIASED)["experts"]
        for name, want in at_step.items():
            got = weights[name]
            assert torch.allclose(got, want, atol=1e-5), (i, name, (got - want).abs().max())
            flat = got.flatten(1)
            assert all(not torch.equal(flat[a], flat[b]) for a in range(len(flat)) for b in range(a)), name


#: DeepSeek's style: sigmoid scores with a selection bias, shared experts, a dense first layer, sequence-wise
#: balancing statistics.
DEEPSEEK_STYLE = replace(TINY_MOE, n_layers=3, dense_layers=1, router_score="sigmoid", router_bias_rate=0.01,
                         aux_loss="sequence", shared_experts=1, router_scale=2.0)


def test_deepseek_style_routing_matches_single_process(token_file):
    ref = moe_reference(token_file, STEPS, model=DEEPSEEK_STYLE)
    results = run_distributed(fit_moe, 4, token_file, 4, model=DEEPSEEK_STYLE, expert_parallel_size=4, zero_stage=1)
    assert_experts_split(results, Ep=4, model=DEEPSEEK_STYLE)
    assert_routes_equal(results, ref)
    assert_parity(results, ref)


def test_bf16_mixed_follows_fp32(token_file, moe_ref):
    """Experts in bf16 (the grouped matmul's dtype on GPUs), the router in fp32: the curve stays within bf16's
    rounding of the fp32 one."""
    from helpers import assert_bf16_curve

    results = run_distributed(fit_moe, 2, token_file, 2, expert_parallel_size=2, zero_stage=2, precision="bf16-mixed")
    for r in results:
        assert r["dtypes"] == {"expert_weights": {"torch.bfloat16"}, "expert_output": "torch.bfloat16",
                               "router_weight": "torch.bfloat16", "router_output": "torch.float32"}, r["dtypes"]
    assert_bf16_curve(results, moe_ref)

