"""The planner's activation bytes against what this Llama keeps for backward: the table of shape x precision x
checkpointing mode x tensor/sequence parallelism (measured, predicted, ratio), per block and for the whole model with
its logits and loss.

One process (tp 1) measures with torch's profiler (the bytes a forward leaves allocated, which also sees selective
checkpointing's store); two forked gloo processes (tp 2, with and without sequence parallelism) measure without
checkpointing, with saved-tensor hooks (the profiler would also count buffers gloo keeps between collectives). Per
block = a 2-block model minus a 1-block one. Micro-batch 2 (tp 1) or 4 (tp 2).
"""

from __future__ import annotations

from dataclasses import replace

import torch

torch.set_num_threads(1)

from lightning_mgpu import LLMModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.planner.memory import block_activation_bytes, head_activation_bytes  # noqa: E402
from lightning_mgpu.measure import kept_forward_bytes  # noqa: E402
from lightning_mgpu.testing import parallel_saved_bytes, run_distributed  # noqa: E402
from smoke import sized  # noqa: E402

SHAPES = [(LlamaConfig(dim=96, n_heads=6, n_kv_heads=2, ffn_hidden=160, vocab_size=50, max_seq_len=128), 40),
          (LlamaConfig(dim=128, n_heads=4, n_kv_heads=4, ffn_hidden=352, vocab_size=300, max_seq_len=128), 64),
          (LlamaConfig(dim=64, n_heads=8, n_kv_heads=2, ffn_hidden=256, vocab_size=64, max_seq_len=128), 96)]
SHAPES = sized(SHAPES, SHAPES[:1])
DTYPES = sized((torch.float32, torch.bfloat16), (torch.float32,))


def _name(cfg: LlamaConfig, seq: int) -> str:
    return f"d{cfg.dim} h{cfg.n_heads}/{cfg.n_kv_heads} f{cfg.ffn_hidden} s{seq}"


def _one_process_rows() -> list[str]:
    rows, batch_size = [], 2
    for cfg, seq in SHAPES:
        batch = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(0))
        for dtype in DTYPES:
            for mode in ("none", "selective", "full"):
                kept = []
                for n_layers in (1, 2):
                    module = LLMModule(replace(cfg, n_layers=n_layers, activation_checkpointing=mode))
                    module.configure_model()
                    module.model.to(dtype).train()
                    module.loss(batch).backward()  # warm-up
                    kept.append(kept_forward_bytes(lambda: module.loss(batch)))
                w, tokens = dtype.itemsize, batch_size * seq
                block = block_activation_bytes(cfg, tokens, mode=mode, element_bytes=w)
                whole = 2 * block + head_activation_bytes(cfg, tokens, element_bytes=w)
                rows.append(_row(_name(cfg, seq), dtype, mode, "tp1", kept[1] - kept[0], block, kept[1], whole))
    return rows


def _two_process_rows(rank: int) -> list[str]:
    import torch.distributed as dist

    from lightning_mgpu.layout import ParallelLayout

    dist.init_process_group("gloo")
    rows, batch_size = [], 4
    for sp in (False, True):
        layout = ParallelLayout(world_size=2, tensor_parallel_size=2, sequence_parallel=sp)
        layout.init_groups(rank)
        for cfg, seq in SHAPES:
            batch = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(0))
            for dtype in DTYPES:
                saved = parallel_saved_bytes(cfg, layout, dtype, batch)
                w, tokens = dtype.itemsize, batch_size * seq
                block = block_activation_bytes(cfg, tokens, 2, sp, "none", w)
                whole = 2 * block + head_activation_bytes(cfg, tokens, 2, sp, w)
                rows.append(_row(_name(cfg, seq), dtype, "none", "tp2+SP" if sp else "tp2", saved[1] - saved[0], block,
                                 saved[1], whole))
    dist.destroy_process_group()
    return rows


def _row(shape: str, dtype: torch.dtype, mode: str, split: str, block: float, planned_block: float, whole: float,
         planned_whole: float) -> str:
    precision = "fp32" if dtype == torch.float32 else "bf16"
    return (f"| {shape} | {precision} | {mode} | {split} | {block / 1e3:.1f} | {planned_block / 1e3:.1f} | "
            f"{block / planned_block:.3f} | {whole / 1e3:.1f} | {planned_whole / 1e3:.1f} | "
            f"{whole / planned_whole:.3f} |")


def main() -> None:
    print("| shape | precision | checkpointing | split | block kB measured | predicted | ratio | model kB measured | "
          "predicted | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in _one_process_rows() + run_distributed(_two_process_rows, 2)[0]:
        print(row)


if __name__ == "__main__":
    main()
