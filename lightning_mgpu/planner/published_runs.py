"""Published bf16 training runs, each with its source and the settings the planner takes, in two sets: the runs the
planner's compute fractions are fitted to (``role="fit"``) and the runs it is judged on (``role="held_out"``), which
no constant was chosen from. ``role="left_out"`` runs are printed with the reason the planner does not model them.

Every figure is copied from the table named in ``source``; a run whose settings are not all published is not here.
Runs left out for that reason, or because the planner cannot express them: DeepSeek V3 and Kimi K2 (multi-head latent
attention), GPT-OSS (sliding-window attention with sinks), NeMo's and Megatron Bridge's DGX-H100 tables of Llama 3
8B-405B and Qwen3 (fp8, which the planner does not model; every Megatron Bridge release table read, 25.09 to 26.08,
has its H100 Llama rows in fp8 and its bf16 H100 rows only for GPT-OSS), torchtitan's H200 runs of Llama 3.1 8B
(float8), torchtitan's 405B runs at tp 8 x pp 8 with context parallelism (float8, and a 500 W power limit), Llama 3
405B's scaling table (read only as quoted elsewhere; micro-batch, virtual stages and recomputation not given beside
it), Megatron-LM's weak-scaling tables of 1.7B-1T (A100) and 2B-462B (H100) models (images, without micro-batch or
recomputation), MT-NLG 530B (micro-batch not given), FlagPerf's Megatron-core Llama 3 runs on H100 (recomputation
listed in the READMEs' A800 setup or against a launch script that sets none). The NVIDIA dgxc-benchmarking tables
(releases 24.11.1 and 25.02) are bf16 beside their yaml; their 405B columns below 576 GPUs are proxies of 7-42 layers
and are not used. No bf16 H200 run with its settings published was found, so neither set has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mgpu.models.llama import LlamaConfig

_FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"
FOUNDRY_H100 = _FOUNDRY + " (table H100 80GB BF16)"
FOUNDRY_A100 = _FOUNDRY + " (table A100 80GB with 1600 Gbps node-node interconnect)"
#: the page's 64 x A100 version (its later versions report H100 runs)
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
TITAN_L3, TITAN_L2 = TORCHTITAN + " (Llama 3 table)", TORCHTITAN + " (Llama 2 table)"
TITAN_H100 = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
AUTOMODEL = ("https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.md (DGX-H100 BF16 "
             "pre-training table; activation checkpointing from "
             "examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml)")
_AUTOMODEL_CP = "https://github.com/NVIDIA-NeMo/Automodel/blob/2013a4dd6e932c4e4f48ca6b4a3fc295cdd64e33/"
#: the row "Llama3 70B" (64 GPUs, context parallel 2); its activation checkpointing is in the config the page links
AUTOMODEL_CP2 = (_AUTOMODEL_CP + "docs/performance-summary.md (DGX-H100 BF16 pre-training table, row Llama3 70B; "
                 "activation_checkpointing: True in examples/llm_pretrain/"
                 "custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml at that commit)")
#: bf16 "Vanilla TP tokens/sec" (per GPU: 256 GPUs), local batch 16; seq_len 8192 and full checkpointing from
#: torchtitan/models/llama3/train_configs/llama3_70b.toml at the commit the page names (820504e)
TITAN_ASYNC_TP = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
                  "(Llama3 70b on 256 H100s, row None (bfloat16))")

_DGXC = "https://github.com/NVIDIA/dgxc-benchmarking/blob/"
_DGXC_2411 = _DGXC + "35a9aecc8d5b17d99d80f52f38c75ade0dbab7ae/"
_DGXC_2502 = _DGXC + "8f5cbb3799ea8cc031ed2c2cee1cbdbc15b240ad/"
#: NVIDIA's dgxc-benchmarking releases 24.11.1 and 25.02 (NeMo, Megatron-core, Transformer Engine) on DGX H100: each
#: README's BF16 table gives the step time and tokens/s by GPU count; the yaml beside it at the same commit, with the
#: overrides of its configure.sh, the shapes, the layout, micro-batch, recomputation and the distributed optimizer
#: (optimizer state sharded over the data-parallel ranks, weights whole)
DGXC_GPT3 = (_DGXC_2411 + "nemo_megatron/README_175b.md (table NeMo Megatron 24.11 BF16, 128x H100; "
             "gpt3_175b_hydra.yaml: GPT-2 BPE, 50,257 padded to 50,688)")
DGXC_L70 = _DGXC_2502 + "llama3.1/README_70b.md (table Llama 3.1 70b BF16, 64x H100; llama3.1_70b.yaml)"
DGXC_L405 = (_DGXC_2502 + "llama3.1/README_405b.md (table Llama 3.1 405b BF16, 576x H100, 126 layers; "
             "llama3.1_405b.yaml; its GPT-2 BPE proxy tokenizer, 50,257 padded to 51,200)")
#: the release that ran it without context parallelism (its README's GA=16 at GBS 32 on 128 GPUs says the same; the
#: 25.02 release's configure.sh sets CP=2 for bf16 beside the same figures)
DGXC_N340 = (_DGXC_2411 + "nemotron/README_340b.md (table Nemotron4 340b 24.11 BF16, 128x H100; "
             "nemotron4-340b-synth.yaml, vocabulary 256,000 from its tokenizer)")
DGXC_N15 = (_DGXC_2502 + "nemotron/README_15b.md (table Nemotron4 15b BF16, 16x H100; nemotron4-15b-synth.yaml, "
            "vocabulary 256,000 from its tokenizer)")
#: the first epoch's last iteration in the log (samples per second 19.561 at 2,048 tokens on 384 A100 80GB, 104.70 s
#: an iteration); TP 4, PP 12, micro-batch 2, full activation checkpointing, DeepSpeed's bf16 optimizer (its own
#: stage-1 sharding) in the slurm script
BLOOM = ("https://github.com/bigscience-workshop/bigscience/blob/00327f8c3533c39b3cc17013f0d0d2b770eb2bb9/train/"
         "tr11-176B-ml/README.md (Important checkpoints; settings in tr11-176B-ml.slurm at "
         "003b25057ea7dd7b476dd2feb28668725b1cbdaa)")

@dataclass(frozen=True)
class PublishedRun:
    """One published measurement: what ran, on what, under which layout, and the tokens per second per GPU it
    reached."""

    name: str
    source: str
    model: LlamaConfig
    gpu: str  #: a key of ``lightning_mgpu.planner.hardware.GPUS``
    gpus: int
    tensor_parallel: int
    seq_len: int
    micro_batch: int
    global_batch: int
    recompute: bool  #: full activation checkpointing (selective is planned as none)
    tokens_per_s_per_gpu: float
    role: str = "fit"  #: "fit", "held_out" or "left_out"
    why_not: str = ""  #: why a left-out run is not modelled
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    #: how the data-parallel ranks shard: 3 (FSDP full sharding), 1 (Megatron's distributed optimizer, DeepSpeed's
    #: bf16 optimizer: optimizer state sharded, weights whole)
    zero_stage: int = 3
    virtual: int = 1  #: pipeline stages per rank (interleaved 1F1B when above 1)
    #: seconds per step where the source prints them beside the throughput: a second reading of the same measurement
    #: (``tests/unit/test_planner_heldout.py`` holds the two equal, so a mistyped figure shows); 0: not printed
    published_step_s: float = 0.0


def _two_matrix_mlp(dim: int, n_layers: int, n_heads: int, seq: int, vocab: int, kv_heads: int = 0,
                    tie: bool = True, multiple: int = 1) -> LlamaConfig:
    """A model whose MLP is two matrices 4 x dim wide (GELU: MPT, GPT-3, BLOOM; squared ReLU: Nemotron-4) as the
    Llama of equal dim, depth, heads and parameter count (SwiGLU width 8/3 x dim, rounded to a ``multiple`` the
    run's tensor parallelism divides)."""
    return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=kv_heads or n_heads,
                       ffn_hidden=multiple * round(8 * dim / (3 * multiple)), vocab_size=vocab, max_seq_len=seq,
                       tie_embeddings=tie)


def _mpt(dim: int, n_layers: int, n_heads: int, seq: int) -> LlamaConfig:
    """llm-foundry's MPT: multi-head attention, tied embeddings, vocabulary 50,368."""
    return _two_matrix_mlp(dim, n_layers, n_heads, seq, 50368)


def _llama2(dim: int, n_layers: int, n_heads: int, n_kv: int, ffn: int) -> LlamaConfig:
    return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, ffn_hidden=ffn, vocab_size=32000,
                       max_seq_len=4096)


def _llama3(name: str, seq: int = 8192) -> LlamaConfig:
    return LlamaConfig.from_name(name, max_seq_len=seq)


QWEN3_30B_A3B = LlamaConfig.from_name("llama3_1b", n_layers=48, n_kv_heads=4, head_dim=128, qk_norm=True,
                                      vocab_size=151936, tie_embeddings=False, rope_theta=1e6, max_seq_len=4096,
                                      num_experts=128, experts_per_token=8, expert_hidden=768)
_M70, _M30, _M13, _M7, _M1 = (8192, 80, 64), (7168, 48, 56), (5120, 40, 40), (4096, 32, 32), (2048, 24, 16)
_H, _A = "h100_80gb", "a100_80gb"
_POWER = "its H100s (HBM2e) ran at a 500 W power limit; the peak assumes the 700 W SXM5 rating"

FIT_RUNS: list[PublishedRun] = [
    PublishedRun("MPT-70B", FOUNDRY_H100, _mpt(*_M70, 2048), _H, 64, 1, 2048, 8, 2048, True, 1039),
    PublishedRun("MPT-30B", FOUNDRY_H100, _mpt(*_M30, 2048), _H, 32, 1, 2048, 14, 1344, True, 2308),
    PublishedRun("MPT-30B", FOUNDRY_H100, _mpt(*_M30, 4096), _H, 8, 1, 4096, 1, 168, True, 1802),
    PublishedRun("MPT-13B", FOUNDRY_H100, _mpt(*_M13, 4096), _H, 8, 1, 4096, 10, 240, True, 4717),
    PublishedRun("MPT-7B", FOUNDRY_H100, _mpt(*_M7, 2048), _H, 8, 1, 2048, 6, 48, False, 10643),
    PublishedRun("MPT-7B", FOUNDRY_H100, _mpt(*_M7, 8192), _H, 8, 1, 8192, 8, 128, True, 6935),
    PublishedRun("MPT-7B", FOUNDRY_H100, _mpt(*_M7, 65536), _H, 8, 1, 65536, 1, 16, True, 1956),
    PublishedRun("MPT-1B", FOUNDRY_H100, _mpt(*_M1, 2048), _H, 8, 1, 2048, 14, 112, False, 45455),
    PublishedRun("MPT-1B", FOUNDRY_H100, _mpt(*_M1, 32768), _H, 8, 1, 32768, 1, 32, False, 12025),
    PublishedRun("Llama 3 8B", TITAN_L3, _llama3("llama3_8b"), _A, 64, 1, 8192, 1, 64, False, 2904),
    PublishedRun("Llama 3 70B", TITAN_L3, _llama3("llama3_70b"), _A, 64, 1, 8192, 1, 64, True, 331),
    PublishedRun("MPT-30B", FOUNDRY_A100, _mpt(*_M30, 4096), _A, 8, 1, 4096, 1, 168, True, 814),
    PublishedRun("MPT-13B", FOUNDRY_A100, _mpt(*_M13, 32768), _A, 8, 1, 32768, 1, 24, True, 1016),
    PublishedRun("MPT-7B", FOUNDRY_A100, _mpt(*_M7, 65536), _A, 8, 1, 65536, 1, 16, True, 1013),
    PublishedRun("MPT-7B", FOUNDRY_A100, _mpt(*_M7, 4096), _A, 8, 1, 4096, 16, 256, True, 3684),
]

_HO = dict(role="held_out")
HELD_OUT_RUNS: list[PublishedRun] = [
    PublishedRun("MPT-70B", FOUNDRY_H100, _mpt(*_M70, 2048), _H, 32, 1, 2048, 2, 1024, True, 882, **_HO),
    PublishedRun("MPT-30B", FOUNDRY_H100, _mpt(*_M30, 8192), _H, 8, 1, 8192, 1, 168, True, 1384, **_HO),
    PublishedRun("MPT-30B", FOUNDRY_H100, _mpt(*_M30, 2048), _H, 16, 1, 2048, 10, 480, True, 2263, **_HO),
    PublishedRun("MPT-30B", FOUNDRY_H100, _mpt(*_M30, 2048), _H, 8, 1, 2048, 3, 504, True, 2002, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_H100, _mpt(*_M13, 32768), _H, 8, 1, 32768, 1, 24, True, 1976, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_H100, _mpt(*_M13, 16384), _H, 8, 1, 16384, 3, 72, True, 2985, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_H100, _mpt(*_M13, 2048), _H, 64, 1, 2048, 2, 128, False, 4800, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_H100, _mpt(*_M13, 2048), _H, 8, 1, 2048, 2, 16, False, 4792, **_HO),
    PublishedRun("MPT-7B", FOUNDRY_H100, _mpt(*_M7, 32768), _H, 8, 1, 32768, 2, 32, True, 3318, **_HO),
    PublishedRun("MPT-7B", FOUNDRY_H100, _mpt(*_M7, 4096), _H, 8, 1, 4096, 16, 256, True, 8611, **_HO),
    PublishedRun("Qwen3-30B-A3B", AUTOMODEL, QWEN3_30B_A3B, _H, 8, 1, 4096, 4, 512, True, 12040, expert=8, **_HO),
    PublishedRun("Llama 3.1 70B", AUTOMODEL_CP2, _llama3("llama3_70b"), _H, 64, 1, 8192, 1, 128, True, 866.77,
                 context=2, **_HO),
    PublishedRun("MPT-70B", FOUNDRY_A100, _mpt(*_M70, 2048), _A, 64, 1, 2048, 8, 2048, True, 410, **_HO),
    PublishedRun("MPT-70B", FOUNDRY_A100, _mpt(*_M70, 2048), _A, 32, 1, 2048, 2, 1024, True, 373, **_HO),
    PublishedRun("MPT-30B", FOUNDRY_A100, _mpt(*_M30, 8192), _A, 8, 1, 8192, 1, 168, True, 574, **_HO),
    PublishedRun("MPT-30B", FOUNDRY_A100, _mpt(*_M30, 2048), _A, 8, 1, 2048, 3, 504, True, 916, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_A100, _mpt(*_M13, 8192), _A, 8, 1, 8192, 5, 120, True, 1795, **_HO),
    PublishedRun("MPT-13B", FOUNDRY_A100, _mpt(*_M13, 2048), _A, 8, 1, 2048, 2, 48, False, 2262, **_HO),
    PublishedRun("MPT-7B", FOUNDRY_A100, _mpt(*_M7, 8192), _A, 8, 1, 8192, 8, 128, True, 3206, **_HO),
    PublishedRun("MPT-7B", FOUNDRY_A100, _mpt(*_M7, 2048), _A, 8, 1, 2048, 6, 96, False, 4641, **_HO),
    PublishedRun("Llama 2 13B", TITAN_L2, _llama2(5120, 40, 40, 40, 13824), _A, 64, 1, 4096, 2, 128, False, 2162,
                 **_HO),
    PublishedRun("Llama 2 70B", TITAN_L2, _llama2(8192, 80, 64, 8, 28672), _A, 64, 1, 4096, 2, 128, True, 353,
                 **_HO),
]

#: tied embeddings under a pipeline planned untied: Megatron keeps a copy on the first and the last stage and sums their
#: gradients, which is what two matrices cost (and this package refuses tying across stages)
_GPT3 = _two_matrix_mlp(12288, 96, 96, 2048, 50688, tie=False)
_BLOOM = _two_matrix_mlp(14336, 70, 112, 2048, 250880, tie=False, multiple=8)
_N340 = _two_matrix_mlp(18432, 96, 96, 4096, 256000, kv_heads=8, tie=False)
_N15 = _two_matrix_mlp(6144, 32, 48, 4096, 256000, kv_heads=8, tie=False)
#: num_query_groups: 16 in its yaml, and the proxy tokenizer's vocabulary
_L405 = LlamaConfig.from_name("llama3_405b", max_seq_len=8192, n_kv_heads=16, vocab_size=51200)
_MEGATRON = dict(role="held_out", zero_stage=1)
HELD_OUT_RUNS += [
    PublishedRun("GPT-3 175B", DGXC_GPT3, _GPT3, _H, 128, 4, 2048, 1, 256, False, 58843 / 128, pipeline=8, virtual=12,
                 published_step_s=8.91, **_MEGATRON),
    PublishedRun("Llama 3.1 70B", DGXC_L70, _llama3("llama3_70b"), _H, 64, 4, 8192, 1, 128, False, 71756 / 64,
                 pipeline=4, virtual=5, context=2, published_step_s=14.61, **_MEGATRON),
    PublishedRun("Llama 3.1 405B", DGXC_L405, _L405, _H, 576, 8, 8192, 1, 252, False, 117964 / 576,
                 pipeline=9, virtual=7, context=2, published_step_s=17.50, **_MEGATRON),
    PublishedRun("Nemotron-4 340B", DGXC_N340, _N340, _H, 128, 8, 4096, 1, 32, False, 28432 / 128, pipeline=8,
                 virtual=12, published_step_s=4.61, **_MEGATRON),
    PublishedRun("Nemotron-4 15B", DGXC_N15, _N15, _H, 16, 4, 4096, 4, 64, False, 93223 / 16, published_step_s=2.812,
                 **_MEGATRON),
    PublishedRun("BLOOM 176B", BLOOM, _BLOOM, _A, 384, 4, 2048, 2, 2048, True, 19.561 * 2048 / 384, pipeline=12,
                 published_step_s=104.70, **_MEGATRON),
]

LEFT_OUT_RUNS: list[PublishedRun] = [
    PublishedRun("Llama 3.1 8B", TITAN_H100 + " (Table 1)", _llama3("llama3_8b"), _H, 8, 1, 8192, 2, 16, False, 5762,
                 role="left_out", why_not=_POWER),
    PublishedRun("Llama 3.1 8B", TITAN_H100 + " (Table 3)", _llama3("llama3_8b"), _H, 128, 1, 8192, 2, 256, False,
                 5605, role="left_out", why_not=_POWER),
    PublishedRun("Llama 3.1 70B", TITAN_ASYNC_TP, _llama3("llama3_70b"), _H, 256, 8, 8192, 16, 512, True, 597.3,
                 role="left_out", why_not=_POWER),
    PublishedRun("Llama 3.1 405B", "torchtitan docs/performance.md, as quoted before", _llama3("llama3_405b"), _H, 128,
                 8, 8192, 2, 32, True, 109, role="left_out",
                 why_not="not in either stored version of the page read (A100 and H100 tables); out until its source "
                         "is found"),
]

PUBLISHED_RUNS: list[PublishedRun] = FIT_RUNS + HELD_OUT_RUNS + LEFT_OUT_RUNS
