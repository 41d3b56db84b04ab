"""A ``transformers`` causal LM as it is, inside a plain LightningModule with its own DataLoader (``hf_helpers``):
tensor (with sequence parallelism), pipeline (1F1B and zero-bubble) and ZeRO parallelism from the plans in its config,
against one process running the same model on the same global batches -- loss and gradient norm each step, the
user's ``labels=`` loss -- and the split asserted applied (local shard sizes, stages held)."""

import functools

import pytest
from hf_helpers import MICRO, fit_hf, global_batches, single_process, tiny_config, tiny_model, token_ids
from helpers import in_turn, max_abs_diff

from lightning_mgpu.testing import run_distributed

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma2", "phi3", "olmo2", "deepseek_v3", "gpt_neox",
            "phi", "gptj", "granitemoe"]
#: Families whose decoder's parts have other names than Llama's, or whose config has no pipeline plan: they run
#: tensor parallelism with sequence parallelism and pipeline stages.
RENAMED = ("gpt_neox", "phi", "gptj", "granitemoe")

#: name -> (ranks, layers, strategy arguments). Each family runs every one.
LAYOUTS = {
    "tp2_sp_zero3": (2, 2, dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=3)),
    "pp2_1f1b_validated": (2, 2, dict(pipeline_parallel_size=2, num_microbatches=2)),
    "pp2_zbv": (2, 4, dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="zbv",
                           num_microbatches=4)),
    "tp2_pp2_dp2_zero1": (8, 2, dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1,
                                     num_microbatches=2)),
    "cp2_zero2": (2, 2, dict(context_parallel_size=2, zero_stage=2)),
}
#: Mistral's sliding window is refused context parallelism (tests/unit/test_hf_plans.py); the mixture of experts
#: runs the layouts that split its attention, data and stages (its experts stay whole on every tensor-parallel rank).
SKIPPED = {("mistral", "cp2_zero2"), *(("qwen3_moe", layout) for layout in ("pp2_1f1b_validated", "pp2_zbv",
                                                                          "cp2_zero2")),
           # Gemma 2 runs what its scaled embedding and padding row (tensor) and its capped logits (last stage) meet
           *(("gemma2", layout) for layout in ("pp2_zbv", "tp2_pp2_dp2_zero1", "cp2_zero2")),
           # Phi-3 and OLMo 2 run their plans' styles of gathered outputs and split inputs, with sequence parallelism
           *((family, layout) for family in ("phi3", "olmo2") for layout in LAYOUTS if layout != "tp2_sp_zero3"),
           # DeepSeek V3 runs its dense first layer beside experts, and its whole attention, under sequence parallelism
           *(("deepseek_v3", layout) for layout in LAYOUTS if layout != "tp2_sp_zero3"),
           *((family, layout) for family in RENAMED for layout in LAYOUTS
             if layout not in ("tp2_sp_zero3", "pp2_1f1b_validated"))}
CASES = [(family, layout) for layout in LAYOUTS for family in FAMILIES if (family, layout) not in SKIPPED]
#: A Llama whose loader yields a TensorDataset's lists, run in the launch of a pipeline layout: (layout, batches).
CONTAINED = [("pp2_1f1b_validated", "labelled"), ("tp2_pp2_dp2_zero1", "list")]


#: The projection a family's plan splits by rows in a layer: the query's, or the fused q/k/v's (Phi-3)
ATTENTION = ("self_attn.q_proj", "self_attn.qkv_proj")
#: ... or the dense first layer's gate, where the plan leaves the attention whole (DeepSeek's)
SPLIT_PROJECTIONS = {"deepseek_v3": ("mlp.gate_proj",), "gpt_neox": ("attention.query_key_value",),
                     "gptj": ("attn.q_proj",),
                     # GraniteMoE's plan (transformers 5.24) splits only its experts, which stay whole here: its
                     # attention runs whole on every rank, under sequence parallelism on the gathered sequence
                     "granitemoe": ()}
#: Where a family keeps its layers, input embeddings and final norm, written out (Llama's names otherwise).
PARTS = {"gpt_neox": ("gpt_neox.layers", "gpt_neox.embed_in", "gpt_neox.final_layer_norm"),
         "phi": ("model.layers", "model.embed_tokens", "model.final_layernorm"),
         "gptj": ("transformer.h", "transformer.wte", "transformer.ln_f")}
LLAMA_PARTS = ("model.layers", "model.embed_tokens", "model.norm")


def assert_split(results: list[dict], family: str, n_layers: int, kw: dict) -> None:
    """Local shapes: a query (or fused q/k/v, or gate) projection keeps 1/T of its rows, the embedding 1/T of the
    vocabulary; a pipeline rank holds its stages' layers only, the embedding on the first stage and the final norm and
    head on the last."""
    whole = {name: tuple(p.shape) for name, p in tiny_model(family, n_layers).named_parameters()}
    layers_at, embedding, norm = PARTS.get(family, LLAMA_PARTS)
    T, P = kw.get("tensor_parallel_size", 1), kw.get("pipeline_parallel_size", 1)
    per_rank = n_layers // (P * kw.get("virtual_pipeline_size", 1))
    for r in results:
        shapes = {name.removeprefix("llm."): shape for name, shape in r["shapes"].items()}
        layers = sorted({int(name.split(".")[2]) for name in shapes if name.startswith(f"{layers_at}.")})
        pp = r["coords"]["pp"]
        if P == 1:
            assert layers == list(range(n_layers))
            own = tiny_config(family)._attn_implementation
            assert r["attention"] == ("mgpu_context_parallel" if kw.get("context_parallel_size", 1) > 1 else own)
        elif kw.get("pipeline_schedule") == "zbv":  # V placement: stages pp and 2P-1-pp
            assert layers == [pp, 2 * P - 1 - pp], (r["rank"], layers)
        else:
            assert layers == list(range(pp * per_rank, (pp + 1) * per_rank)), (r["rank"], layers)
        holds = [f"{part}.weight" in shapes for part in (embedding, norm, "lm_head")]
        head_rank = 0 if kw.get("pipeline_schedule") == "zbv" else P - 1
        assert holds == [pp == 0, pp == head_rank, pp == head_rank], (r["rank"], holds)
        q = next((f"{layers_at}.{layers[0]}.{name}.weight" for name in SPLIT_PROJECTIONS.get(family, ATTENTION)
                  if f"{layers_at}.{layers[0]}.{name}.weight" in shapes), None)
        if q is not None or family not in SPLIT_PROJECTIONS:
            assert shapes[q] == (whole[q][0] // T, whole[q][1]), (q, shapes[q])
        if holds[0]:
            assert shapes[f"{embedding}.weight"][0] == whole[f"{embedding}.weight"][0] // T


@functools.cache
def every_family(layout: str) -> dict[str, list[dict]]:
    """Every family's run on ``layout``, in one launch of its ranks (a fresh Trainer each); each rank's results, by
    family."""
    ranks, n_layers, kw = LAYOUTS[layout]
    calls = {family: (fit_hf, (family, ranks), dict(n_layers=n_layers, validate=layout.endswith("validated"), **kw))
             for family in FAMILIES if (family, layout) not in SKIPPED}
    calls.update({f"llama[{batches}]": (fit_hf, ("llama", ranks), dict(n_layers=n_layers, batches=batches, **kw))
                  for name, batches in CONTAINED if name == layout})
    results = run_distributed(in_turn, ranks, calls)
    return {family: [r[family] for r in results] for family in calls}


@pytest.mark.parametrize("family, layout", CASES)
def test_parity_with_one_process(family, layout):
    ranks, n_layers, kw = LAYOUTS[layout]
    validate = layout.endswith("validated")
    results = every_family(layout)[family]
    expected = single_process(family, global_batches(results), n_layers,
                              validation=token_ids(8)[:MICRO] if validate else None)
    assert_split(results, family, n_layers, kw)
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (r["rank"], r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (r["rank"], r["grad_norms"],
                                                                              expected["grad_norms"])
        if validate:
            assert abs(r["val_loss"] - expected["val_loss"]) < 1e-5, (r["val_loss"], expected["val_loss"])


@pytest.mark.parametrize("layout, batches", CONTAINED)
def test_a_batch_in_a_tensor_datasets_list_trains_as_the_bare_tensor(layout, batches):
    """The loader yields ``[ids]`` or ``[ids, labels]`` (labels that count 3/4 of each row, so that a run that took
    the ids for labels fails): the stages read the ids and labels from the list, and the loss and grad norm equal one
    process computing the model's loss over those labels."""
    ranks, n_layers, kw = LAYOUTS[layout]
    results = every_family(layout)[f"llama[{batches}]"]
    expected = single_process("llama", global_batches(results), n_layers, labelled=batches == "labelled")
    assert_split(results, "llama", n_layers, kw)
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (r["rank"], r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (r["rank"], r["grad_norms"],
                                                                              expected["grad_norms"])


#: name -> (the layout that saves after 2 steps, the layout that resumes for 2 more)
RESUMES = {
    "tp2_sp->dp2_zero1": (dict(tensor_parallel_size=2, sequence_parallel=True), dict(zero_stage=1)),
    "pp2->tp2_zero3": (dict(pipeline_parallel_size=2, num_microbatches=2), dict(tensor_parallel_size=2, zero_stage=3)),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each case's saving runs in one launch of 2 ranks, then its resuming runs in another: name -> (first, second)."""
    directory = tmp_path_factory.mktemp("hf_resumes")
    paths = {name: str(directory / f"saved{i}") for i, name in enumerate(RESUMES)}
    first = run_distributed(in_turn, 2, {name: (fit_hf, ("qwen3", 2), dict(steps=2, save_to=paths[name], **saved))
                                         for name, (saved, _) in RESUMES.items()})
    second = run_distributed(in_turn, 2, {name: (fit_hf, ("qwen3", 2), dict(steps=4, ckpt_path=paths[name], **kw))
                                          for name, (_, kw) in RESUMES.items()})
    return {name: ([r[name] for r in first], [r[name] for r in second]) for name in RESUMES}


@pytest.mark.parametrize("name", RESUMES)
def test_a_universal_checkpoint_resumes_on_another_layout(resumed, name):
    """Qwen3 (its q/k norms whole on every rank): 2 steps on one layout, saved; 2 more steps on another from that
    checkpoint. The 4 steps equal one process training on the batches each part was given: the weights and AdamW's
    moments came back whole from the shards and stages, under the names the model has without stages (a run that
    ignored the checkpoint fails it)."""
    first, second = resumed[name]
    assert [len(r["losses"]) for r in first + second] == [2, 2, 2, 2]
    expected = single_process("qwen3", global_batches(first) + global_batches(second))
    # 2e-5: pp2 -> tp2 ZeRO-3 sums in another order over 4 steps at LR 1e-2 and parts from one process by 1.1e-5 in
    # loss (transformers 5.24, a loss of 1.26: 9e-6 relative); a resume that lost the weights or moments is off by 1e-1
    for r in second:
        assert max_abs_diff(r["losses"], expected["losses"][2:]) < 2e-5, (r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"][2:]) < 2e-5
