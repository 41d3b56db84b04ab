"""Memory per GPU of a layout: model states as DeepSpeed allocates them, activations as Megatron's formulas say.

Model states, per parameter held by the rank (``w`` = 2 bytes in bf16-mixed, 4 in fp32; ``N`` = data-parallel
size), measured on this project's engine (tests/distributed/test_planner_memory.py checks them to 5%):

========  ==========  ===========  =========================  ==========  =========================
ZeRO      parameters  gradients    fp32 master                Adam        buffers
========  ==========  ===========  =========================  ==========  =========================
0         w           w            4 (bf16), none (fp32)      8           none
1         w           w (pp: w/N)  4 / N                      8 / N       one bucket of w elements (pp: none)
2         w           w / N        4 / N                      8 / N       none
3         w / N       w / N        4 / N                      8 / N       one bucket of w-byte elements
========  ==========  ===========  =========================  ==========  =========================

DeepSpeed keeps a separate fp32 master partition even in fp32 training (FIELD-NOTES), hence the 4 / N.

Activations per transformer block and micro-batch, in bytes, with ``s`` sequence, ``b`` micro-batch,
``h`` hidden size, ``t`` tensor-parallel size (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", with the attention-score term ``5as/h`` dropped because
``scaled_dot_product_attention`` does not store the scores): ``34 s b h`` without tensor parallelism,
``s b h (10 + 24 / t)`` with it, ``34 s b h / t`` with sequence parallelism, and ``2 s b h`` (``/ t`` with
sequence parallelism) for a block whose forward is recomputed (only its input is kept). With pipeline
parallelism the first stage holds ``P`` micro-batches in flight under 1F1B (``P (1 + (P - 1) / (P V))`` with
``V`` interleaved stages per rank). The head's fp32 logits and their bf16 copy add ``6 s b V / t``.

Packed documents (``LlamaConfig.eod_token_id``) add, per micro-batch and stage chunk in flight (not per block), the
``[b, 1, s, s]`` attention bias in the activations' dtype and the per-token rotary tables (cos and sin, fp32,
``4 b s d_head`` bytes): every block of a chunk shares them, and ``scaled_dot_product_attention`` saves a bias of the
query's dtype as it is. Measured with saved-tensor hooks on this Llama (fp32, CPU, torch 2.13): masked minus
unmasked saved bytes are exactly ``4 b s^2 + 4 b s d_head`` at 2 and 4 blocks alike
(tests/unit/test_packed_documents.py). Neither is split by tensor or sequence parallelism: attention sees whole
sequences.

Context parallelism over ``C`` ranks (``context``) gives each rank ``s / C`` tokens of every sequence: the per-block
terms and the logits above are taken at ``s / C``. Each block also keeps the keys and values of the whole sequence
gathered from the other ranks, ``2 s b (kv heads x head dim) / t`` elements (``t``: their tensor-parallel shard), of
which its own ``s / C`` are already in the formula. Model states partition over the ``dp x C`` ranks that hold the
same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mgpu.engine.config import bucket_elements_for
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.model_stats import max_rank_parameters



@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def model_state_bytes(n_params: int, zero_stage: int, dp: int, precision: str = "bf16-mixed",
                      pipelined: bool = False, overlap: bool = False) -> dict[str, float]:
    """Parameters, gradients, optimizer state and buffers (bytes) for ``n_params`` parameters held by one rank.

    ``overlap`` (the engine's default on CUDA, ZeRO 2 and 3 only: ``lightning_mgpu.engine.zero_config``) adds the second
    reduce bucket DeepSpeed allocates to reduce one bucket while the next fills (measured on CPU at ZeRO-2, dp 2:
    0.52 -> 1.05 MB of buckets).

    With pipeline parallelism ZeRO-1 holds what ZeRO-2 holds (measured): the schedule runs inside
    DeepSpeed's coalesced reduction, which reduces every gradient into its partition, frees the rest and keeps
    no bucket.
    """
    w = 4 if precision == "32-true" else 2
    partitioned_grads = zero_stage >= 2 or (pipelined and zero_stage == 1)
    master = (0 if w == 4 else 4) if zero_stage == 0 else 4 / dp
    adam = 8 if zero_stage == 0 else 8 / dp
    bucket = bucket_elements_for(n_params) * w
    return {
        "parameters": n_params * (w / dp if zero_stage == 3 else w),
        "gradients": n_params * (w / dp if partitioned_grads else w),
        "optimizer": n_params * (master + adam),
        "buffers": float(bucket if zero_stage == 3 or (zero_stage == 1 and not pipelined) else 0)
                   + float(bucket if overlap and zero_stage >= 2 else 0),
    }


def activation_bytes(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, virtual: int,
                     sequence_parallel: bool, recompute: bool, context: int = 1) -> float:
    """Activation memory of the fullest pipeline rank (the first), including the head's logits."""
    s, b, h = seq_len / context, micro_batch, cfg.dim
    if recompute:
        per_block = 2 * s * b * h / (tp if sequence_parallel else 1)
        working = s * b * h * (34 / tp if sequence_parallel else (10 + 24 / tp))  # one block being recomputed
    else:
        per_block = s * b * h * (34 / tp if sequence_parallel else (10 + 24 / tp if tp > 1 else 34))
        working = 0.0
    blocks_per_rank = -(-cfg.n_layers // pp)
    in_flight = 1.0 if pp == 1 else pp * (1 + (pp - 1) / (pp * virtual)) if virtual > 1 else float(pp)
    logits = 6 * s * b * cfg.vocab_size / tp
    # in_flight counts whole ranks' activations; a rank holds `virtual` chunks, each with its own document bias
    documents = document_mask_bytes(cfg, seq_len, b) * in_flight * virtual
    # context parallelism: the rest of the sequence's keys and values, gathered (2 bytes: bf16 activations)
    gathered = 0.0 if recompute else 2 * 2 * (seq_len - s) * b * cfg.n_kv_heads * cfg.head_dim / tp
    return (per_block + gathered) * blocks_per_rank * in_flight + working + logits + documents


def document_mask_bytes(cfg: LlamaConfig, seq_len: int, micro_batch: int, element_bytes: int = 2) -> float:
    """Bytes one stage chunk keeps for backward per micro-batch for packed documents: the ``[b, 1, s, s]`` attention
    bias of ``element_bytes`` per element (2: the bf16 activations the formulas above are written for) and the fp32
    per-token rotary tables; 0 without ``eod_token_id``."""
    if cfg.eod_token_id is None:
        return 0.0
    s, b = seq_len, micro_batch
    return element_bytes * b * s * s + 4 * b * s * cfg.head_dim


def estimate_memory(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, dp: int, zero_stage: int,
                    virtual: int = 1, sequence_parallel: bool = False, recompute: bool = False,
                    precision: str = "bf16-mixed", overlap: bool = False, context: int = 1) -> MemoryEstimate:
    """Peak memory per GPU of the fullest rank (``overlap``: as the engine runs on CUDA, see
    :func:`model_state_bytes`; ``dp`` replicas of ``context`` ranks each)."""
    states = model_state_bytes(max_rank_parameters(cfg, tp, pp, virtual), zero_stage, dp * context, precision, pp > 1,
                               overlap)
    acts = activation_bytes(cfg, seq_len, micro_batch, tp, pp, virtual, sequence_parallel, recompute, context)
    return MemoryEstimate(activations=acts, **states)
