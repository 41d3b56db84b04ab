"""How :class:`~lightning_mgpu.models.llama.Llama` is split: its tensor-parallel plan and its pipeline stages.

The plan is data, applied by :func:`lightning_mgpu.parallel.plan.apply_tensor_parallel`. Attention heads
are split by splitting ``wq`` (query heads) and ``wk``/``wv`` (key/value heads) by output rows, so each
rank keeps whole heads and its query heads' own key/value group. Pipeline stages are contiguous runs of
blocks; the first stage also holds the embedding, the last the final norm and the head.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional, Sequence, Union

import torch
from torch import nn

from lightning_mgpu.layout import stage_count_problems, tied_embedding_problems
from lightning_mgpu.models.llama import Llama, LlamaConfig, document_positions, run_layers
from lightning_mgpu.problems import format_problems

#: Module name pattern -> tensor-parallel style (see ``lightning_mgpu.parallel.plan``).
LLAMA_TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "norm",
    "output": "vocab_output",
}


def llama_tp_plan(prefix: str = "", config: Optional[LlamaConfig] = None) -> dict[str, str]:
    """The Llama plan with every pattern under ``prefix`` (e.g. ``"model."`` inside a LightningModule). A model whose
    every layer is a mixture of experts has no dense MLP to split (``lightning_mgpu.parallel.experts`` splits the
    experts)."""
    dense = config is None or any(not config.is_moe_layer(i) for i in range(config.n_layers))
    return {prefix + key: style for key, style in LLAMA_TP_PLAN.items() if dense or ".feed_forward." not in key}


class LlamaStage(nn.Module):
    """Blocks ``[start, end)`` of a :class:`Llama`, sharing its modules; tokens in on the first stage, logits out
    of the last, hidden states ``[batch, seq, dim]`` in between.

    With documents (``LlamaConfig.eod_token_id``) only the first stage sees the tokens, so a stage that is not the
    last hands on ``(hidden states, positions)``: the int64 positions of :func:`document_positions`, from which the
    next stage makes its rotary tables and attention bias. ``torch.distributed.pipelining`` sends every tensor a stage
    returns and passes them to the next stage as its arguments; integer tensors get no gradient.
    Positions rather than the ``[batch, 1, seq, seq]`` bias are sent: ``seq`` times fewer elements.
    """

    def __init__(self, model: Llama, start: int, end: int) -> None:
        super().__init__()
        first, last = start == 0, end == model.config.n_layers
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.eod_token_id = model.config.eod_token_id

    def forward(self, x: torch.Tensor,
                positions: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.tok_embeddings is not None:
            if self.eod_token_id is not None and positions is None:  # given with the tokens of a context chunk
                positions = document_positions(x, self.eod_token_id)
            x = self.tok_embeddings(x)
        x = run_layers(self.layers.values(), x, self.rope_cos, self.rope_sin, positions)
        if self.output is not None:
            return self.output(self.norm(x))
        return x if positions is None else (x, positions)


def balanced_boundaries(n_layers: int, num_stages: int) -> list[int]:
    """``num_stages + 1`` block indices from 0 to ``n_layers``: stage ``i`` runs blocks ``[b[i], b[i+1])``.

    Block counts differ by at most one; extra blocks go to middle stages first, since the first and last
    stages also carry the embedding and the head."""
    return list(_balanced_boundaries(n_layers, num_stages))


@functools.lru_cache(maxsize=None)
def _balanced_boundaries(n_layers: int, num_stages: int) -> tuple[int, ...]:
    """Cached: the planner asks for the same few splits once per candidate layout and pipeline rank."""
    base, extra = divmod(n_layers, num_stages)
    order = sorted(range(num_stages), key=lambda i: (i in (0, num_stages - 1), i))
    more = set(order[:extra])
    return tuple(itertools.accumulate((base + (i in more) for i in range(num_stages)), initial=0))


def boundary_problems(boundaries: Sequence[int], n_layers: int, num_stages: int) -> list[str]:
    """Why ``boundaries`` (``num_stages + 1`` block indices, 0 first and ``n_layers`` last) cannot split the model."""
    b = list(boundaries)
    example = balanced_boundaries(n_layers, num_stages)
    if len(b) != num_stages + 1 or b[0] != 0 or b[-1] != n_layers or any(x >= y for x, y in zip(b, b[1:])):
        return [f"pipeline_boundaries={b} must be {num_stages + 1} strictly increasing block indices from 0 to "
                f"n_layers={n_layers} (one stage per pipeline_parallel_size*virtual_pipeline_size={num_stages}), "
                f"e.g. {example}"]
    return []


def llama_stages(model: Llama, stage_ids: Sequence[int], num_stages: int,
                 boundaries: Optional[Sequence[int]] = None) -> dict[int, LlamaStage]:
    """This rank's stages of ``model`` (``stage_id -> LlamaStage``), balanced by block count unless
    ``boundaries`` says where each stage starts."""
    n = model.config.n_layers
    problems = boundary_problems(boundaries, n, num_stages) if boundaries is not None else []
    problems += tied_embedding_problems(num_stages, model.config.tie_embeddings) + stage_count_problems(num_stages, n)
    if problems:
        raise ValueError(format_problems("Cannot split the model into pipeline stages", problems))
    b = list(boundaries) if boundaries is not None else balanced_boundaries(n, num_stages)
    return {i: LlamaStage(model, b[i], b[i + 1]) for i in stage_ids}
