"""Fine-tuning a ``transformers`` model with PEFT's LoRA (or with parts of it frozen by the user) inside a plain
LightningModule (``peft_helpers``), on tensor (with sequence parallelism), pipeline (1F1B and a zero-bubble schedule),
context and ZeRO parallelism and their composition, against a plain PEFT loop in one process over the same global
batches: the loss and the trainable parameters' gradient norm each step, every trained weight after the last step, every
frozen weight unchanged bit for bit -- and the split asserted applied (adapters split like their base layers)."""

import functools

import pytest
import torch
from hf_helpers import global_batches
from helpers import in_turn, max_abs_diff
from peft_helpers import fit_adapted, single_process_adapted

from lightning_mgpu.testing import run_distributed

#: LoRA on the attention only, for the mixture of experts (its experts are fused parameters, not linears). DoRA runs
#: where nothing splits its layers' features (ZeRO); under tensor parallelism it is refused (test_adapter_plans.py).
#: A base stored in bf16 under fp32 adapters (32-true) keeps its dtype and trains as in one process.
ATTENTION = dict(targets=["q_proj", "k_proj", "v_proj", "o_proj"])

#: name -> (ranks, layers, strategy arguments, the runs: (kind, family, LoRA arguments))
LAYOUTS = {
    "tp2_sp": (2, 2, dict(tensor_parallel_size=2, sequence_parallel=True),
               [("lora", "llama", {}), ("lora", "qwen3", {}), ("lora", "qwen3_moe", ATTENTION), ("frozen", "llama", {}),
                # the head trained whole beside the adapters (split over the vocabulary), and Phi-3's fused q/k/v and
                # gate/up (column-parallel outputs gathered, row-parallel inputs split)
                ("lora", "llama", dict(modules_to_save=["lm_head"])), ("lora", "phi3", {})]),
    "pp2_1f1b_zero1": (2, 2, dict(pipeline_parallel_size=2, num_microbatches=2, zero_stage=1),
                       [("lora", "llama", {}), ("lora", "qwen3", {}), ("lora", "qwen3_moe", ATTENTION),
                        ("frozen", "llama", {})]),
    "pp2_zbv": (2, 4, dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="zbv",
                           num_microbatches=4), [("lora", "llama", {}), ("lora", "qwen3", {}),
                                                 ("lora", "qwen3_moe", ATTENTION), ("frozen", "llama", {})]),
    "cp2_zero2": (2, 2, dict(context_parallel_size=2, zero_stage=2), [("lora", "llama", {}), ("lora", "qwen3", {}),
                                                                      ("lora", "qwen3_moe", ATTENTION)]),
    # experts split over 2 ranks and frozen, the attention's adapters trained, the optimizer given every parameter
    # (ZeRO-1's optimizer once refused the model, then failed on a group of frozen experts alone)
    "ep2_zero1": (2, 2, dict(expert_parallel_size=2, zero_stage=1, optimizer="sgd:every"),
                  [("lora", "qwen3_moe", ATTENTION)]),
    "dp2_zero3": (2, 2, dict(zero_stage=3), [("lora", "llama", {}), ("lora", "qwen3", {}),
                                             ("lora", "qwen3_moe", ATTENTION), ("lora", "qwen3", dict(use_dora=True)),
                                             ("lora", "llama", dict(base_dtype="bfloat16"))]),
    "tp2_pp2_dp2_zero1": (8, 2, dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1,
                                     num_microbatches=2), [("lora", "llama", {}), ("lora", "qwen3", {}),
                                                           ("lora", "qwen3_moe", ATTENTION)]),
}


def run_name(kind: str, family: str, lora: dict) -> str:
    extra = {"base_dtype": "-bf16_base", "modules_to_save": "-saved_head"}
    return f"{'dora' if lora.get('use_dora') else kind}-{family}" + "".join(v for k, v in extra.items() if k in lora)


CASES = [(layout, run_name(*run)) for layout, (_, _, _, runs) in LAYOUTS.items() for run in runs]


@functools.cache
def every_run(layout: str) -> dict[str, tuple[list[dict], tuple]]:
    """Every run of ``layout`` in one launch of its ranks (a fresh Trainer each): name -> (each rank's results, run)."""
    ranks, n_layers, kw, runs = LAYOUTS[layout]
    calls = {run_name(kind, family, lora): (fit_adapted, (kind, family, ranks), dict(n_layers=n_layers, lora=lora, **kw))
             for kind, family, lora in runs}
    results = run_distributed(in_turn, ranks, calls)
    return {name: ([r[name] for r in results], run) for name, run in zip(calls, runs)}


def assert_adapters_split(results: list[dict], expected: dict, kw: dict) -> None:
    """Local shapes: q_proj's (column-parallel) adapter keeps A whole and 1/T of B's rows, o_proj's (row-parallel) 1/T
    of A's columns and B whole; under ZeRO-3 the shapes are those before partitioning."""
    T = kw.get("tensor_parallel_size", 1)
    whole = {name: tuple(w.shape) for name, w in expected["weights"].items()}
    for r in results:
        for name, shape in r["shapes"].items():
            if ".q_proj.lora_A." in name or ".o_proj.lora_B." in name:
                assert shape == whole[name], (name, shape)
            elif ".q_proj.lora_B." in name:
                assert shape == (whole[name][0] // T, whole[name][1]), (name, shape)
            elif ".o_proj.lora_A." in name:
                assert shape == (whole[name][0], whole[name][1] // T), (name, shape)


@pytest.mark.parametrize("layout, name", CASES)
def test_adapters_train_as_in_one_process(layout, name):
    ranks, n_layers, kw, _ = LAYOUTS[layout]
    results, (kind, family, lora) = every_run(layout)[name]
    expected = single_process_adapted(kind, family, global_batches(results), n_layers, lora)
    assert_adapters_split(results, expected, kw)
    # a bf16 base rounds the layers' inputs: the first step is exact, after it the fp32 sums' order (1e-7) flips some
    # roundings (measured: 3.4e-5 in loss at step 3, dp2 ZeRO-3)
    tol = 1e-4 if lora.get("base_dtype") else 1e-5
    for r in results:
        assert abs(r["losses"][0] - expected["losses"][0]) < 1e-6, (r["losses"], expected["losses"])
        assert max_abs_diff(r["losses"], expected["losses"]) < tol, (r["rank"], r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < tol, (r["grad_norms"], expected["grad_norms"])
        # what trains here is what trains in one process (the placeholder of a rank with nothing to train is not)
        assert set(r["trainable"]) <= set(expected["trainable"]), set(r["trainable"]) - set(expected["trainable"])
        assert not r["frozen_with_grads"], r["frozen_with_grads"]
        if lora.get("base_dtype"):  # the base stays bf16 on every rank, the adapters fp32
            assert r["dtypes"] == ["torch.bfloat16 frozen", "torch.float32 trains"], r["dtypes"]
    trained = results[0]["weights"]
    assert set(trained) == set(expected["weights"]), set(trained) ^ set(expected["weights"])
    for weight, value in expected["weights"].items():
        if weight in expected["trainable"]:
            assert torch.allclose(trained[weight], value, rtol=0, atol=tol), weight
        else:  # frozen: bit for bit
            assert torch.equal(trained[weight], value), weight
    # the adapters moved (a test of a run that trained nothing would pass the rest)
    start = single_process_adapted(kind, family, [], n_layers, lora)["weights"]
    assert any(not torch.equal(trained[w], start[w]) for w in expected["trainable"])


@pytest.mark.parametrize("layout", ["pp2_1f1b_zero1", "dp2_zero3", "tp2_pp2_dp2_zero1"])
def test_frozen_weights_have_no_master_copy_and_no_optimizer_state(layout):
    """ZeRO keeps fp32 masters and Adam-free SGD state only of what trains: a rank's master elements, times the ranks
    that partition them, are the trainable elements of its shard (plus DeepSpeed's alignment padding, under 2 x 16 x
    the groups), never the frozen base's."""
    ranks, _, kw, _ = LAYOUTS[layout]
    for results, (kind, family, _) in every_run(layout).values():
        for r in results:
            trainable = r["trainable_elements"]
            held = r["master_elements"] * r["zero_ranks"]
            assert trainable <= held < trainable + 64 * r["zero_ranks"], (r["rank"], trainable, held, r["frozen_elements"])
            if kind == "lora":  # the base, frozen, is more than the masters could hold
                assert r["frozen_elements"] > held, (r["frozen_elements"], held)
