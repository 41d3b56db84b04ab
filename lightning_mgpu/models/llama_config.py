"""The shape and options of the Llama decoder (:class:`LlamaConfig`), its rules, and the named shapes.

Plain Python: nothing here builds a tensor, so the planner and the command line read shapes without torch models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

from lightning_mgpu.models.moe import moe_problems
from lightning_mgpu.problems import format_problems


#: Activation checkpointing modes: keep every activation for backward; keep only the matrix multiplications' outputs
#: and recompute attention and the element-wise ops (selective recomputation, Korthikanti et al.); keep only each
#: block's input and recompute the whole block.
ACTIVATION_CHECKPOINTING = ("none", "selective", "full")


def activation_checkpointing_problems(value: str, key: str) -> list[str]:
    """The one rule for an activation checkpointing mode, worded with the config ``key`` that set it."""
    if value in ACTIVATION_CHECKPOINTING:
        return []
    return [f"{key}={value!r} is not an activation checkpointing mode; choose one of "
            f"{', '.join(ACTIVATION_CHECKPOINTING)}"]


class _Derived(int):
    """A value computed from other fields: :func:`dataclasses.replace` passes it back, and it is derived again."""


class _HeadDim:
    """``LlamaConfig.head_dim``: stored as given (0: derived), read as the width of a head (``dim // n_heads`` when 0).

    A descriptor rather than a property so that ``head_dim`` is a field (``LlamaConfig(head_dim=128)``, ``to_dict``)
    while every reader gets the width; the derived width reads as :class:`_Derived`, so ``replace(cfg, dim=...)``
    derives it again instead of keeping the old one."""

    def __get__(self, obj: object, owner: type = None) -> int:
        if obj is None:
            return 0  # the field's default
        raw = obj.__dict__.get("head_dim", 0)
        return raw or _Derived(obj.dim // obj.n_heads)

    def __set__(self, obj: object, value: int) -> None:
        obj.__dict__["head_dim"] = 0 if isinstance(value, _Derived) else value


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and options of a :class:`Llama` model."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 192
    vocab_size: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    #: Width of one attention head; 0: ``dim // n_heads``. Qwen3 sets it apart (2048 wide, 32 heads of 128).
    head_dim: int = _HeadDim()  # type: ignore[assignment]
    #: RMSNorm over each head of the queries and the keys before rotary embeddings (Qwen3's ``q_norm``, ``k_norm``).
    qk_norm: bool = False
    #: Applied to the blocks from outside (``lightning_mgpu.parallel.checkpointing``), not by this file.
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    #: ``torch.compile`` each block with ``compile_backend``; applied from outside (lightning_mgpu.parallel.compile).
    compile: bool = False
    compile_backend: str = "inductor"
    init_std: float = 0.02
    #: The token that ends a document in packed samples, or None. When set, attention stays within each document of
    #: a sample and rotary positions restart at 0 after every such token (a document ends *after* it). The model
    #: finds the documents in its input tokens, so batches need no extra tensor and every data source works.
    eod_token_id: Optional[int] = None
    #: Mixture of experts (0: a dense model; the fields below then keep their defaults, see ``models.moe``).
    num_experts: int = 0
    experts_per_token: int = 2  #: top-k
    expert_hidden: int = 0  #: each expert's SwiGLU width (0: ``ffn_hidden``)
    shared_experts: int = 0  #: experts every token goes through, besides its routed ones
    dense_layers: int = 0  #: the first layers keep a dense MLP (DeepSeek)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    router_renormalize: bool = True  #: the top-k weights divided by their sum
    router_scale: float = 1.0  #: the routed weights multiplied by it
    capacity_factor: Optional[float] = None  #: None: dropless
    aux_loss: Literal["none", "micro_batch", "sequence", "global_batch"] = "micro_batch"
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    router_bias_rate: float = 0.0  #: > 0: auxiliary-loss-free balancing by a per-expert bias, moved this much a step

    def __post_init__(self) -> None:
        problems = []
        explicit = self.__dict__["head_dim"]
        if explicit < 0:
            problems.append(f"head_dim={explicit} must be positive, or 0 for dim // n_heads")
        elif not explicit and self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; change one, or give "
                            "head_dim explicitly")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.n_heads > 0 and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        problems += activation_checkpointing_problems(self.activation_checkpointing, "activation_checkpointing")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.eod_token_id is not None and not 0 <= self.eod_token_id < self.vocab_size:
            problems.append(f"eod_token_id={self.eod_token_id} is not a token id of vocab_size={self.vocab_size}; "
                            f"give an id in [0, {self.vocab_size}) or None (no document masking)")
        problems += moe_problems(self)
        if problems:
            raise ValueError(format_problems("Invalid LlamaConfig", problems))

    @property
    def expert_ffn_hidden(self) -> int:
        return self.expert_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index >= self.dense_layers

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count, computed from the shape (no model is built); ``active``: only the parameters one token
        goes through (its ``experts_per_token`` routed experts, not all of them)."""
        hd = self.head_dim
        attn = self.dim * (self.n_heads * hd) * 2 + self.dim * (self.n_kv_heads * hd) * 2
        attn += 2 * hd if self.qk_norm else 0  # q_norm, k_norm
        dense_block = attn + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        expert = 3 * self.dim * self.expert_ffn_hidden
        routed = self.experts_per_token if active else self.num_experts
        moe_block = attn + 2 * self.dim + self.dim * self.num_experts + expert * (routed + self.shared_experts)
        moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return (self.n_layers - moe) * dense_block + moe * moe_block + emb + self.dim

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LlamaConfig":
        """A named shape (``tiny``, ``llama3_1b``, ``llama3_8b``, ``llama3_70b``, ``llama3_405b``)."""
        if name not in LLAMA_SHAPES:
            raise ValueError(f"model {name!r} is unknown; choose one of {', '.join(LLAMA_SHAPES)}")
        return replace(LLAMA_SHAPES[name], **overrides)

    def to_dict(self) -> dict:
        """The fields as given (``head_dim`` 0 where derived), so that ``LlamaConfig(**d)`` is this config."""
        return {**asdict(self), "head_dim": self.__dict__["head_dim"]}


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=8192, n_kv_heads=8)
#: Named shapes: ``tiny`` for CPUs, and the published Llama-3 shapes.
LLAMA_SHAPES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "llama3_1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, ffn_hidden=8192, tie_embeddings=True, **_LLAMA3),
    "llama3_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, **_LLAMA3),
    "llama3_70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672, **_LLAMA3),
    "llama3_405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248, **_LLAMA3),
}
