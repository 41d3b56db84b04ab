"""The mixture-of-experts layer in one process: grouped matmuls against a per-token loop, deterministic routing,
capacity, the balancing losses and their injected gradient, the bias update, and the config's rules."""

import pytest
import torch
import torch.nn.functional as F

from lightning_mgpu.models.llama import Llama, LlamaConfig
from lightning_mgpu.models.moe import (MoEFeedForward, _padded_matmul, grouped_matmul, moe_layers,
                                       set_loss_scale)

MOE = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, num_experts=4,
                  experts_per_token=2, shared_experts=1, aux_loss_coeff=0.1, z_loss_coeff=0.01)


def per_token_reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The layer written the slow, obvious way: every token through each of its experts, one at a time."""
    flat = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(flat @ layer.router.gate.weight.T, -1)
    weights, chosen = scores.topk(layer.cfg.experts_per_token, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    e = layer.experts
    out = []
    for t in range(flat.shape[0]):
        row = sum(w * (F.silu(flat[t] @ e.w1[i]) * (flat[t] @ e.w3[i])) @ e.w2[i]
                  for w, i in zip(weights[t], chosen[t].tolist()))
        s = layer.shared_experts
        out.append(row + (F.silu(flat[t] @ s.w1[0]) * (flat[t] @ s.w3[0])) @ s.w2[0])
    return torch.stack(out).view_as(x)


def test_layer_equals_a_per_token_loop():
    torch.manual_seed(0)
    model = Llama(MOE)
    layer = model.layers[0].feed_forward
    x = torch.randn(2, 8, 32)
    assert torch.allclose(layer(x), per_token_reference(layer, x), atol=1e-5)


def test_padded_fallback_equals_grouped_matmul():
    x, w = torch.randn(10, 8), torch.randn(3, 8, 16)
    counts = torch.tensor([3, 0, 7])
    assert torch.allclose(grouped_matmul(x, w, counts), _padded_matmul(x, w, counts), atol=1e-6)


def test_routing_is_deterministic_and_breaks_ties_by_expert_index():
    layer = Llama(MOE).layers[0].feed_forward
    with torch.no_grad():
        layer.router.gate.weight.zero_()  # every score equal: a stable sort keeps experts 0 and 1
    layer(torch.randn(1, 4, 32))
    assert layer.router.routes.tolist() == [[0, 1]] * 4
    assert float(layer.stats["margin"]) == 0.0  # the near-tie is visible


def test_capacity_drops_the_overflow_only():
    cfg = LlamaConfig(**{**MOE.to_dict(), "capacity_factor": 0.5, "shared_experts": 0})
    layer = Llama(cfg).layers[0].feed_forward
    with torch.no_grad():
        layer.router.gate.weight.zero_()
    x = torch.randn(1, 8, 32)
    out = layer(x)  # all 16 assignments go to experts 0 and 1; capacity ceil(0.5 * 8 * 2 / 4) = 2 each
    assert float(layer.stats["dropped"]) == pytest.approx(1 - 4 / 16)
    e = layer.experts
    kept = sum(0.5 * (F.silu(x[0, :2] @ e.w1[i]) * (x[0, :2] @ e.w3[i])) @ e.w2[i] for i in (0, 1))
    assert torch.allclose(out[0, :2], kept, atol=1e-6)  # the first two tokens keep both their experts
    assert torch.equal(out[0, 2:], torch.zeros_like(out[0, 2:]))  # the others lost theirs (no shared experts here)


def test_aux_loss_is_mixtrals_over_top_k():
    """Ours is 1 when balanced, ``transformers``' Mixtral loss is ``top_k``: the same statistic, independently
    written (their ``load_balancing_loss_func`` on the same router logits)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = LlamaConfig(**{**MOE.to_dict(), "shared_experts": 0, "z_loss_coeff": 0.0})
    layer = Llama(cfg).layers[0].feed_forward
    x = torch.randn(2, 8, 32)
    layer(x)
    logits = layer.router.gate(x.reshape(-1, 32))
    theirs = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    assert float(layer.stats["aux_loss"]) * 2 == pytest.approx(float(theirs), rel=1e-6)


def test_balanced_routing_has_aux_loss_one():
    from lightning_mgpu.models.moe import MoEWiring, balance_loss

    scores = torch.full((8, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3]] * 4)
    for kind in ("micro_batch", "sequence"):
        assert float(balance_loss(scores, experts, 2, kind, "softmax", MoEWiring())) == pytest.approx(1.0)


def test_injected_loss_gradient_equals_adding_the_loss():
    torch.manual_seed(0)
    model = Llama(MOE)
    tokens = torch.randint(0, 64, (2, 16))
    set_loss_scale(model, 0.5)
    (0.5 * model(tokens).square().mean()).backward()
    injected = model.layers[1].feed_forward.router.gate.weight.grad.clone()
    model.zero_grad()
    set_loss_scale(model, 0.0)  # nothing injected: the losses are added to the training loss instead
    losses = []
    for layer in moe_layers(model):
        layer.router.register_forward_hook(lambda module, args, route: losses.append(route.loss))
    out = model(tokens)
    (0.5 * (out.square().mean() + sum(losses))).backward()
    assert torch.allclose(model.layers[1].feed_forward.router.gate.weight.grad, injected, atol=1e-7)
    assert injected.abs().sum() > 0


def test_bias_update_moves_towards_balance_identically():
    cfg = LlamaConfig(**{**MOE.to_dict(), "router_bias_rate": 0.01, "router_score": "sigmoid"})
    router = Llama(cfg).layers[0].feed_forward.router
    router.update_bias(torch.tensor([10, 2, 4, 0]))
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert "layers.0.feed_forward.router.expert_bias" in Llama(cfg).state_dict()  # saved with the weights
    assert "layers.0.feed_forward.router.expert_bias" not in Llama(MOE).state_dict()


def test_config_names_every_problem():
    with pytest.raises(ValueError) as err:
        LlamaConfig(**{**MOE.to_dict(), "experts_per_token": 5, "capacity_factor": -1.0, "aux_loss": "always",
                       "dense_layers": 2})
    text = str(err.value)
    for part in ("experts_per_token=5", "capacity_factor=-1.0", "aux_loss='always'", "dense_layers=2"):
        assert part in text
    with pytest.raises(ValueError, match="only apply to a mixture-of-experts model"):
        LlamaConfig(router_score="sigmoid")


def test_counts_are_exact_and_active_parameters_count_top_k():
    model = Llama(MOE)
    assert sum(p.numel() for p in model.parameters()) == MOE.num_parameters()
    expert = 3 * 32 * 64
    assert MOE.num_parameters() - MOE.num_parameters(active=True) == 2 * (4 - 2) * expert


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_forward_recomputed_in_backward_is_not_counted_again(mode):
    from lightning_mgpu.parallel.checkpointing import checkpoint_blocks

    model = Llama(MOE)
    checkpoint_blocks(list(model.layers), mode)
    model(torch.randint(0, 64, (2, 8))).square().mean().backward()
    for layer in moe_layers(model):  # 16 tokens, 2 experts each: once, though the block ran twice
        assert float(layer.router.step_counts.sum()) == 16 * 2
