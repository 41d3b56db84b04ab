"""A custom model gives the planner its own per-block activation numbers: measured for its block
(``measure.block_bytes_per_token``) and returned by a ``LlamaConfig`` subclass's ``block_activation_bytes``,
which the planner then uses in place of its Llama formula."""

from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.models.llama import Block, Llama
from lightning_mgpu.planner import estimate_memory
from lightning_mgpu.measure import block_bytes_per_token, kept_forward_bytes, measured_block_bytes
from lightning_mgpu.planner.memory import activation_bytes, block_activation_bytes, head_activation_bytes

LLAMA = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=64, max_seq_len=128)


class GeluBlock(nn.Module):
    """Not this Llama's block: LayerNorm, a GELU MLP four times as wide, a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def test_measuring_this_llamas_block_gives_the_planners_own_formula():
    model = Llama(LLAMA)

    def inputs(n: int) -> tuple:
        x = torch.randn(1, n, LLAMA.dim, requires_grad=True)
        return x, model.rope_cos[:n], model.rope_sin[:n]

    table = block_bytes_per_token(lambda: Block(LLAMA), inputs)
    for mode, (per_token, once) in table.items():
        for tokens in (64, 96):
            derived = block_activation_bytes(LLAMA, tokens, mode=mode, element_bytes=4)
            assert abs((per_token * tokens + once) / derived - 1) < 0.02, (mode, tokens, per_token, once, derived)


@dataclass(frozen=True)
class GeluConfig(LlamaConfig):
    """The custom model's sizes, for parameter counts and FLOPs, with its own measured per-block bytes."""

    measured: tuple = ()  # (mode, (bytes per token, bytes per block)) pairs, hashable as the config is

    def block_activation_bytes(self, tokens, tp, sequence_parallel, mode, element_bytes):
        return measured_block_bytes(dict(self.measured), 4)(tokens, tp, sequence_parallel, mode, element_bytes)


def test_the_planner_uses_a_custom_models_own_block_numbers():
    dim, n_layers, tokens = 64, 3, 96
    table = block_bytes_per_token(lambda: GeluBlock(dim), lambda n: (torch.randn(1, n, dim, requires_grad=True),))
    assert table["full"][0] < table["selective"][0] < table["none"][0]
    cfg = GeluConfig(**{**vars(replace(LLAMA, n_layers=n_layers)), "measured": tuple(table.items())})
    head = head_activation_bytes(cfg, tokens, element_bytes=4)
    for mode in ("none", "selective", "full"):
        planned = activation_bytes(cfg, tokens, 1, 1, 1, 1, False, False, precision="32-true", mode=mode) - head
        per_block = table[mode][0] * tokens + table[mode][1]
        working = 0.0 if mode == "none" else table["none"][0] * tokens + table["none"][1]
        assert planned == pytest.approx(n_layers * per_block + working)
        assert planned != pytest.approx(activation_bytes(LLAMA, tokens, 1, 1, 1, 1, False, False, precision="32-true",
                                                         mode=mode) - head)
    # what a stack of the custom blocks keeps is what the planner now counts for its blocks
    stack = nn.Sequential(*(GeluBlock(dim) for _ in range(n_layers))).train()
    x = torch.randn(1, tokens, dim, requires_grad=True)
    stack(x).sum().backward()
    kept = kept_forward_bytes(lambda: stack(x)) + x.nbytes  # the first block's input, kept, made before the forward
    planned = estimate_memory(cfg, tokens, 1, 1, 1, 1, 0, precision="32-true").activations - head
    assert abs(kept / planned - 1) < 0.05, (kept, planned)
