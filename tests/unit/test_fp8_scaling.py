"""fp8 without processes: the grouped experts against torchao's fp8 matmul run expert by expert, which layers convert,
the sizes the GPU kernels refuse, and the setting's refusals."""

import dataclasses

import pytest
import torch
from torch import nn

from lightning_mgpu import MGPUPrecision
from lightning_mgpu.models import Llama, LlamaConfig

MOE = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                  num_experts=4, experts_per_token=2, shared_experts=1, dense_layers=1)


def _per_expert_torchao(x, w, counts, go, recipe):
    """Each expert's rows times its weight by torchao's own fp8 matmul (``matmul_with_hp_or_float8_args``, emulated):
    the output and the gradients of ``x`` and ``w`` for the incoming gradient ``go``."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True,
                                 round_scales_to_power_of_2=True)  # the package's scales, both recipes
    mm = LinearMMConfig(*(ScaledMMConfig(True, g.use_fast_accum, False, False) for g in (
        config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)))
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    outs = [matmul_with_hp_or_float8_args.apply(rows, w[e], mm, config) for e, rows in enumerate(x.split(counts))
            if len(rows)]  # torchao's amax refuses an empty tensor; an expert without rows has no output
    y = torch.cat(outs)
    y.backward(go)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_grouped_experts_equal_torchaos_fp8_matmul_per_expert(recipe):
    """The grouped fp8 matmul (one expert's rows one token group) equals torchao's fp8 matmul run on each expert's
    rows apart, in the output and both gradients, with an expert that gets no row; and differs from the matmul in
    fp32 (so fp8 rounding happened)."""
    from lightning_mgpu.fp8 import Fp8Spec
    from lightning_mgpu.fp8.grouped import Fp8GroupedMatmul
    from lightning_mgpu.models.moe import grouped_matmul

    torch.manual_seed(0)
    counts = [5, 0, 7]
    x, w, go = torch.randn(12, 32), torch.randn(3, 32, 16), torch.randn(12, 16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = Fp8GroupedMatmul.apply(xg, wg, torch.tensor(counts).view(-1, 1), Fp8Spec(recipe))
    y.backward(go)
    want = _per_expert_torchao(x, w, counts, go, recipe)
    for got, expected in zip((y.detach(), xg.grad, wg.grad), want):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()
    assert (y.detach() - grouped_matmul(x, w, torch.tensor(counts))).abs().max() > 1e-2


def test_every_linear_layer_converts_and_nothing_else():
    """Attention, the dense MLP, the grouped routed and shared experts and the head compute in fp8; the router's gate
    (fp32 on purpose), embeddings and norms stay as they are, and the parameters keep their names."""
    from lightning_mgpu.fp8 import Fp8Linear, convert_to_fp8
    from lightning_mgpu.fp8.grouped import Fp8Grouped
    from lightning_mgpu.models.moe import RouterGate

    model = Llama(MOE)
    names_before = [n for n, _ in model.named_parameters()]
    converted = convert_to_fp8(model, "rowwise")
    assert sorted(converted) == sorted(
        [f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")]
        + [f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")]
        + ["layers.1.feed_forward.experts", "layers.1.feed_forward.shared_experts", "output"])
    gate = model.layers[1].feed_forward.router.gate
    assert type(gate) is RouterGate and not isinstance(gate, Fp8Linear)
    assert isinstance(model.layers[1].feed_forward.experts.matmul, Fp8Grouped)
    assert type(model.tok_embeddings) is nn.Embedding and [n for n, _ in model.named_parameters()] == names_before
    loss = model(torch.randint(0, 64, (2, 8))).float().logsumexp(-1).mean()
    loss.backward()  # forward and backward run with every layer converted
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" not in n)


def test_sizes_the_gpu_kernels_refuse_are_named():
    """Every layer whose local (input, output) features are not multiples of 16 is named with its sizes, at once;
    a tensor-parallel shard counts with its own size."""
    from lightning_mgpu.fp8 import convert_to_fp8, kernel_size_problems, local_sizes

    model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 40), nn.Linear(40, 16), nn.Linear(16, 48))
    convert_to_fp8(model, "rowwise")
    problems = [str(p) for p in kernel_size_problems(local_sizes(model))]
    assert len(problems) == 3
    assert problems[0].startswith("fp8 layer 0=(24, 32) has (input, output) features") and "multiples of 16" in problems[0]
    assert problems[1].startswith("fp8 layer 2=(32, 40)") and problems[2].startswith("fp8 layer 3=(40, 16)")
    assert local_sizes(model)["4"] == (16, 48)


def test_fp8_setting_refuses_unknown_recipes_with_the_other_problems():
    MGPUPrecision("bf16-mixed", fp8="rowwise")
    MGPUPrecision("16-mixed", fp8="tensorwise")
    with pytest.raises(ValueError) as err:
        MGPUPrecision("64-true", fp8="fp4")
    message = str(err.value)
    assert "precision='64-true' is not supported" in message
    assert "fp8='fp4' is not one of torchao's float8 training recipes; choose 'rowwise' or 'tensorwise', or leave it " \
        "unset (off)" in message


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_hugging_face_model_as_it_is_equals_torchaos_conversion(family):
    """A ``transformers`` model converts as torchao converts it, layer for layer (every ``nn.Linear``: Qwen2's carry
    biases), to the same loss and gradients. Qwen3-MoE's router and fused experts are modules of its own, not
    ``nn.Linear``: they stay in high precision under either."""
    import copy

    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear_utils import convert_to_float8_training

    from hf_helpers import tiny_model, token_ids
    from lightning_mgpu.fp8 import convert_to_fp8

    ours = tiny_model(family)
    theirs = copy.deepcopy(ours)
    linears = sorted(name for name, m in ours.named_modules() if type(m) is nn.Linear)
    assert sorted(convert_to_fp8(ours, "rowwise")) == linears and linears
    assert not any(name.endswith((".mlp.gate", ".mlp.experts")) for name in linears)
    convert_to_float8_training(theirs, config=dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"),
                                                                  emulate=True))
    ids = token_ids(4)
    results = []
    for model in (ours, theirs):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    assert all(torch.allclose(results[0][1][n], results[1][1][n], atol=1e-7) for n in results[0][1])


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_an_experts_token_groups_scale_apart_as_separate_micro_batches(recipe):
    """Under expert parallelism an expert receives a token group from each rank: the grouped fp8 matmul over both
    groups equals two calls, one per rank's micro-batch, as one process runs them (outputs row for row, weight
    gradients summed), also where one group's values are 2**-14 times the other's; scaling the two as one group does
    not."""
    from lightning_mgpu.fp8 import Fp8Spec
    from lightning_mgpu.fp8.grouped import Fp8GroupedMatmul

    torch.manual_seed(0)
    small = torch.tensor([1.0, 1.0, 1.0, 2.0**-14, 2.0**-14, 2.0**-14, 1.0, 2.0**-14]).unsqueeze(1)
    x = torch.randn(8, 32) * small  # expert 0: 3 rows from rank 0, 3 from rank 1; expert 1: 1 and 1
    go, w = torch.randn(8, 16) / small, torch.randn(2, 32, 16)  # small inputs, large gradients: products alike
    ranks = [[0, 1, 2, 6], [3, 4, 5, 7]]

    def run(rows, groups):
        xi, wi = x[rows].clone().requires_grad_(), w.clone().requires_grad_()
        y = Fp8GroupedMatmul.apply(xi, wi, torch.tensor(groups), Fp8Spec(recipe))
        y.backward(go[rows])
        return y.detach(), xi.grad, wi.grad

    apart = [run(rows, [[3], [1]]) for rows in ranks]
    order = [0, 1, 2, 4, 5, 6, 3, 7]  # the two ranks' rows as the expert receives them, expert by expert
    for groups, equal in (([[3, 3], [1, 1]], True), ([[6], [2]], False)):
        y, gx, gw = run(list(range(8)), groups)
        want_y = torch.cat([apart[0][0], apart[1][0]])[order]
        want_gx = torch.cat([apart[0][1], apart[1][1]])[order]
        same = [torch.allclose(a, b, rtol=1e-5, atol=0) for a, b in
                ((y, want_y), (gx, want_gx), (gw, apart[0][2] + apart[1][2]))]
        assert all(same) if equal else not all(same), (groups, same)
