"""Tensor-parallel plans checked without processes: every problem with a plan is reported at once."""

from torch import nn

from lightning_mgpu.models import LLAMA_TP_PLAN, Llama, LlamaConfig, llama_tp_plan
from lightning_mgpu.parallel.plan import STYLES, plan_problems, resolve_plan
from lightning_mgpu.parallel.tensor import padded_size

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=63)


def test_llama_plan_covers_every_matmul_and_norm():
    model = Llama(CFG)
    resolved, problems = resolve_plan(model, LLAMA_TP_PLAN)
    assert problems == []
    linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert linears <= set(resolved)
    assert resolved["layers.1.attention.wk"] == "colwise" and resolved["layers.0.feed_forward.w2"] == "rowwise"
    assert plan_problems(model, LLAMA_TP_PLAN, 2) == []


def test_plan_keys_follow_a_prefix():
    assert llama_tp_plan("model.")["model.output"] == "vocab_output"


def test_every_plan_problem_is_listed_at_once():
    model = Llama(CFG)
    plan = dict(LLAMA_TP_PLAN)
    plan.update({"layers.*.attention.wq": "colwize",  # typo
                 "layers.*.mlp.fc": "colwise",  # no such module
                 "layers.*.attention": "rowwise",  # not a Linear
                 "layers.*": "norm"})  # Block has many parameters
    problems = plan_problems(model, plan, 3)
    text = "\n".join(problems)
    assert "style 'colwize' is unknown" in text and "choose one of " + ", ".join(STYLES) in text
    assert "'layers.*.mlp.fc' matches no module" in text
    assert "'layers.0.attention' is a Attention; style 'rowwise' needs an nn.Linear" in text
    assert "cannot use style 'norm'" in text
    assert "tensor_parallel_size=3 does not divide layers.0.feed_forward.w2.in_features=64" in text
    assert "tensor_parallel_size=3 does not divide layers.0.attention.wk.out_features=16" in text


def test_vocabulary_is_padded_to_a_multiple():
    assert [padded_size(v, 4) for v in (63, 64, 65)] == [64, 64, 68]
