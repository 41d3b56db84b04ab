"""Tensor-parallel plans checked without processes: every problem with a plan is reported at once."""

import torch
from torch import nn

from lightning_mgpu.models import LLAMA_TP_PLAN, Llama, LlamaConfig, llama_tp_plan
from lightning_mgpu.parallel.plan import STYLES, plan_problems, resolve_plan
from lightning_mgpu.parallel.tensor import embedding_output_scale, padded_size

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


class ScaledLinear(nn.Linear):
    """A layer whose class does more than its base's matmul: swapping it would drop the doubling."""

    def forward(self, x):
        return 2 * super().forward(x)


class ScaledEmbedding(nn.Embedding):
    """The form of transformers' scaled word embeddings (Gemma): a constant kept as a float and as a buffer."""

    def __init__(self, n: int, dim: int, scale: float) -> None:
        super().__init__(n, dim)
        self.scalar_embed_scale = scale
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


def test_a_module_whose_class_has_its_own_forward_is_refused_unless_a_scaled_embedding():
    model = nn.Sequential(ScaledEmbedding(8, 4, 3.0), ScaledLinear(4, 4), nn.Linear(4, 4))
    problems = plan_problems(model, {"0": "vocab_embedding", "1": "colwise_enter", "2": "rowwise"}, 2)
    assert problems == ["'1' is a ScaledLinear, whose own forward would be lost: style 'colwise_enter' swaps it for a "
                        "tensor-parallel nn.Linear; leave it out of the plan (whole on every rank) or make it a plain "
                        "nn.Linear"]
    assert embedding_output_scale(model[0]) == 3.0 and embedding_output_scale(nn.Embedding(8, 4)) is None

