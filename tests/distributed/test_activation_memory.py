"""The planner's activation bytes under tensor parallelism (tp2) and sequence parallelism, against what each rank's
forward saves for backward (saved-tensor hooks, each storage once): three shapes, fp32 and bf16, per block and for the
whole model with its vocabulary-parallel logits and loss, on one 2-process launch."""

import torch

from lightning_mgpu.testing import run_distributed

#: (shape, sequence), as in tests/unit/test_activation_formulas.py
SHAPES = [(dict(dim=96, n_heads=6, n_kv_heads=2, ffn_hidden=160, vocab_size=50, max_seq_len=128), 40),
          (dict(dim=128, n_heads=4, n_kv_heads=4, ffn_hidden=352, vocab_size=300, max_seq_len=128), 64),
          (dict(dim=64, n_heads=8, n_kv_heads=2, ffn_hidden=256, vocab_size=64, max_seq_len=128), 96)]
BATCH = 4


def _measure(rank: int) -> list[tuple]:
    """(sequence parallel, shape, dtype bytes, measured block, planned block, measured whole, planned whole)."""
    import torch.distributed as dist

    from lightning_mgpu.layout import ParallelLayout
    from lightning_mgpu.models import LlamaConfig
    from lightning_mgpu.planner.memory import block_activation_bytes, head_activation_bytes
    from lightning_mgpu.testing import parallel_saved_bytes

    dist.init_process_group("gloo")
    rows = []
    for sp in (False, True):
        layout = ParallelLayout(world_size=2, tensor_parallel_size=2, sequence_parallel=sp)
        layout.init_groups(rank)
        for index, (shape, seq) in enumerate(SHAPES):
            cfg = LlamaConfig(**shape)
            batch = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
            for dtype in (torch.float32, torch.bfloat16):
                saved = parallel_saved_bytes(cfg, layout, dtype, batch)
                w, tokens = dtype.itemsize, BATCH * seq
                block = block_activation_bytes(cfg, tokens, 2, sp, "none", w)
                rows.append((sp, index, w, saved[1] - saved[0], block, saved[1],
                             2 * block + head_activation_bytes(cfg, tokens, 2, sp, w)))
    dist.destroy_process_group()
    return rows


def test_planned_activations_match_each_tensor_parallel_ranks_saved_tensors():
    for rows in run_distributed(_measure, 2):
        assert len(rows) == 12
        for sp, shape, w, block, planned_block, whole, planned_whole in rows:
            where = f"sp={sp} shape {shape} {w}-byte activations"
            assert abs(block / planned_block - 1) < 0.10, (where, block, planned_block)
            assert abs(whole / planned_whole - 1) < 0.10, (where, whole, planned_whole)
