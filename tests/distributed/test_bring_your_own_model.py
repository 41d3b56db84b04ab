"""Bring your own model: a small GPT in plain PyTorch, given a tensor-parallel plan, trains at tp=2 at parity.

This file is also the worked example of docs/how-to/own-model.md.
"""

import lightning as L
import torch
import torch.nn.functional as F
from helpers import GLOBAL_BATCH, SEQ_LEN, STEPS, fit, global_batches, max_abs_diff
from torch import nn

from lightning_mgpu.parallel.cross_entropy import cross_entropy
from lightning_mgpu.testing import run_distributed


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads are counted from the projection's width, so a plan that splits q/k/v needs no change here.
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), SelfAttention(dim, n_heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, max_len: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, n_heads) for _ in range(n_layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


#: The plan: which module is split how. Norms feeding split layers are "norm"; the layers reading their output are
#: "colwise"; the layers summing back to the residual stream are "rowwise".
GPT_TP_PLAN = {
    "gpt.wte": "vocab_embedding",
    "gpt.blocks.*.ln_1": "norm",
    "gpt.blocks.*.attn.q": "colwise",
    "gpt.blocks.*.attn.k": "colwise",
    "gpt.blocks.*.attn.v": "colwise",
    "gpt.blocks.*.attn.proj": "rowwise",
    "gpt.blocks.*.ln_2": "norm",
    "gpt.blocks.*.mlp.0": "colwise",
    "gpt.blocks.*.mlp.2": "rowwise",
    "gpt.ln_f": "norm",
    "gpt.lm_head": "vocab_output",
}


class GPTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = None

    def configure_model(self) -> None:
        if self.gpt is None:
            torch.manual_seed(0)  # every rank builds the same full model; the plan keeps each rank's shard
            self.gpt = GPT()

    def tensor_parallel_plan(self) -> dict:
        return GPT_TP_PLAN

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.gpt(batch[:, :-1])  # sharded over the vocabulary under tensor parallelism
        return cross_entropy(logits, batch[:, 1:], head=self.gpt.lm_head)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


def single_process(token_file, steps: int, clip: float) -> dict:
    module = GPTModule()
    module.configure_model()
    optimizer = module.configure_optimizers()
    losses, norms = [], []
    for batch in global_batches(token_file, steps, GLOBAL_BATCH, SEQ_LEN):
        loss = module.training_step(batch, 0)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


def test_own_gpt_with_a_plan_trains_at_tp2_at_parity(token_file):
    expected = single_process(token_file, steps=STEPS, clip=0.3)
    results = run_distributed(fit, 2, token_file, 2, module=GPTModule(), tensor_parallel_size=2)
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5
    assert expected["losses"][-1] < expected["losses"][0] - 0.1


def test_own_gpt_is_refused_context_parallelism_by_name(token_file):
    """Context parallelism needs an attention kernel it can replace and a module that splits its batch; a plain
    LightningModule has neither and is told so before its first step, not trained wrongly."""
    import pytest

    with pytest.raises(Exception, match="context_parallel_size=2 needs a module whose attention exposes a replaceable"):
        run_distributed(fit, 2, token_file, 2, module=GPTModule(), max_steps=1, context_parallel_size=2)
