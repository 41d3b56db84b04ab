"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Architecture only. This file imports nothing distributed: tensor and pipeline parallelism are applied
from outside (see ``llama_plan.py`` and ``lightning_mgpu.parallel``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.models.llama_config import LlamaConfig
from lightning_mgpu.models.moe import MoEFeedForward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim // 2] for rotary position embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [batch, heads, seq, head_dim] (the Hugging Face convention).

    ``cos``/``sin`` are ``[seq, head_dim // 2]`` (positions 0, 1, ...) or ``[batch, 1, seq, head_dim // 2]`` (each
    token's own position, see :func:`document_inputs`)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def document_positions(tokens: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """Each token's position in its document, ``[batch, seq]`` int64: 0 at the start of the sample and on the token
    after every ``eod_token_id`` (the end-of-document token belongs to the document it ends).

    Positions are what the model passes between pipeline stages: they give both the rotary angles and the documents
    (token ``i``'s document starts at ``i - position[i]``)."""
    b, s = tokens.shape
    index = torch.arange(s, device=tokens.device).expand(b, s)
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(tokens[:, :-1] == eod_token_id, index[:, 1:], 0)
    return index - starts.cummax(dim=1).values


def document_inputs(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin, attention bias) of packed documents for every block, from :func:`document_positions`.

    The rotary tables are gathered at each token's position (``[batch, 1, seq, head_dim // 2]``). The bias is
    block-diagonal causal, ``[batch, 1, seq, seq]``: 0 where query ``i`` may see key ``j`` (same document, ``j <= i``),
    ``-inf`` elsewhere. It is an additive bias in the activations' dtype rather than a boolean mask because
    ``scaled_dot_product_attention`` converts a boolean mask into a new bias of that kind on every call and saves the
    copy for backward, one per block; a bias given in that dtype is saved as it is, so all blocks of a forward share
    one (measured on CPU, torch 2.13). Every row allows its diagonal, so no row is all ``-inf``.
    """
    s = positions.shape[1]
    index = torch.arange(s, device=positions.device)
    first = (index - positions).unsqueeze(-1)  # [b, s, 1]: where query i's document starts
    allowed = (index <= index.unsqueeze(-1)) & (index >= first)  # [b, s, s]: first[i] <= j <= i
    bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, float("-inf"))
    # Real positions are below max_seq_len (the tables' length) already. The clamp is for a pipeline stage run on
    # uninitialised tensors, as torch.distributed.pipelining does once to infer its output shapes.
    rows = positions.clamp(0, cos.shape[0] - 1)
    return cos[rows].unsqueeze(1), sin[rows].unsqueeze(1), bias.unsqueeze(1)


def expand_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each key/value head for the query heads that share it."""
    if k.shape[1] != n_heads:
        rep = n_heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


#: What an attention kernel gets: q ``[b, heads, s, head_dim]``, k and v ``[b, kv_heads, s, head_dim]`` (before rotary
#: embeddings), the rotary tables (``[positions, head_dim // 2]``, row p for position p; or per token with documents)
#: and the documents' bias (or None); it returns ``[b, heads, s, head_dim]``.
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            Optional[torch.Tensor]], torch.Tensor]


def attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotary embeddings and causal attention over a whole sequence held here (positions 0, 1, ...); with ``bias``
    (and per-token ``cos``/``sin``, see :func:`document_inputs`) within documents. The part of attention that sees
    the whole sequence, so the part a context-parallel plan replaces (``Attention.kernel``)."""
    if bias is None:
        cos, sin = cos[: q.shape[2]], sin[: q.shape[2]]  # tables may be longer than this sequence
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = expand_kv(k, v, q.shape[1])
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))  # no copy if equal


class Attention(nn.Module):
    """Grouped-query causal self-attention. Head counts are read from the projections, so a
    tensor-parallel plan that shards them leaves this code unchanged; ``kernel`` (an :data:`AttentionKernel`, by
    default :func:`attention_kernel`) is what a context-parallel plan swaps."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Built only when asked: the default model keeps exactly its parameters and names.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.kernel: AttentionKernel = attention_kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention; with ``bias`` (and per-token ``cos``/``sin``, see :func:`document_inputs`) within
        documents."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:  # per head, before rotary embeddings (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = self.kernel(q, k, v, cos, sin, bias)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention, then a SwiGLU MLP or, in a mixture-of-experts layer (``cfg.is_moe_layer(index)``), experts."""

    def __init__(self, cfg: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, bias)
        return x + self.feed_forward(self.ffn_norm(x))


def run_layers(layers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply transformer blocks in order (activation checkpointing, when configured, is applied to the blocks from
    outside: ``lightning_mgpu.parallel.checkpointing``).

    With ``positions`` (:func:`document_positions`) attention stays within documents: the per-token rotary tables and
    the bias are made once here and shared by every block, by the blocks' attention kernel where it makes its own (a
    kernel that sees keys this process does not hold: context parallelism), by :func:`document_inputs` otherwise."""
    bias = None
    layers = list(layers)
    if positions is not None:
        kernel = next((m.kernel for m in layers[0].modules() if isinstance(m, Attention)), None) if layers else None
        cos, sin, bias = getattr(kernel, "document_inputs", document_inputs)(positions, cos, sin, x.dtype)
    extra = () if bias is None else (bias,)  # the default path calls blocks exactly as before
    for layer in layers:
        x = layer(x, cos, sin, *extra)
    return x


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A random stream for one parameter, from the seed and the parameter's name only: a parameter gets the same initial
    value whichever other parameters a process builds, in whatever order (a pipeline stage builds only its own)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def initial_value(cfg: LlamaConfig, name: str, shape: torch.Size, seed: int,
                  experts: Optional[slice] = None) -> torch.Tensor:
    """The initial value of parameter ``name`` of a :class:`Llama` (its whole, unsplit tensor): norms 1; block
    output projections Normal(0, init_std / sqrt(2 * n_layers)) (GPT-2); everything else Normal(0, init_std).

    Stacked expert weights (3-D) draw each expert from its own stream (``name/e``), so ``experts`` (a slice of the
    first dimension) gives those experts without drawing the others: a rank fills only the experts it holds."""
    if len(shape) == 1:
        return torch.ones(shape, device="cpu")
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight", ".w2")) \
        else cfg.init_std
    if len(shape) == 3:
        wanted = range(shape[0])[experts or slice(None)]
        return torch.stack([torch.empty(shape[1:], device="cpu").normal_(
            0.0, std, generator=parameter_generator(seed, f"{name}/{e}")) for e in wanted])
    # on the CPU, like its generator, whatever default device a strategy set (the caller copies it where it belongs)
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=parameter_generator(seed, name))


class Llama(nn.Module):
    """Decoder-only transformer returning logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]``.

    Built under ``torch.device("meta")`` its parameters take no memory and get no values (a parallel strategy then
    gives each rank only its share, from :func:`initial_value`); the rotary tables are computed on the CPU even then,
    since they are derived, not learned.
    """

    def __init__(self, cfg: LlamaConfig, init_seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.output.weight.is_meta:
            self.reset_parameters(init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Every parameter from :func:`initial_value` with ``seed``."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.config, name, p.shape, seed))

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of ``tokens``; with documents (``eod_token_id``) each token's ``positions`` in its document, computed
        here unless given (a part of a sequence, such as a context-parallel chunk, cannot compute them)."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        eod = self.config.eod_token_id
        if positions is None and eod is not None:
            positions = document_positions(tokens, eod)
        return self.output(self.norm(run_layers(self.layers, self.tok_embeddings(tokens), self.rope_cos,
                                                self.rope_sin, positions)))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: Optional[int] = 20, generator: Optional[torch.Generator] = None,
                 logits_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 seq_multiple: int = 1) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuation tokens after ``prompt`` [batch, seq] (no KV cache: for demos).

        ``logits_hook`` post-processes each step's logits (e.g. gathers vocabulary shards); ``seq_multiple``
        right-pads the context to a multiple of it, which a causal model ignores (e.g. for sequence shards).
        """
        tokens = prompt
        window = self.config.max_seq_len // seq_multiple * seq_multiple
        for _ in range(max_new_tokens):
            context = tokens[:, -window:]
            last = context.shape[1] - 1
            pad = -context.shape[1] % seq_multiple
            if pad:
                context = torch.cat([context, context.new_zeros((context.shape[0], pad))], dim=1)
            logits = self(context)[:, last]
            if logits_hook is not None:
                logits = logits_hook(logits)
            logits = logits.float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens
