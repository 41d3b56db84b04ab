"""Context parallelism on CPU: step time, per-rank compute and collective volume at cp1, cp2 and cp4 for one fixed
sequence, with balanced (two chunks per rank: early + late) and contiguous (one chunk per rank) splits.

Each configuration runs forward + backward of the next-token loss of a 4-block Llama (dim 256, 8 heads, 2 key/value
heads) on one 2,048-token sequence, on ``C`` forked gloo processes with one thread each, ``STEPS`` steps after a
warm-up. Per step it records the wall time of the slowest rank, each rank's own CPU time (``time.process_time``,
unaffected by ranks sharing cores) and the bytes the context group's collectives move (counted at
``torch.distributed``: the key/value all-gathers forward, their reduce-scatters backward). With more processes than
cores the wall time measures the machine, not the method: read the per-rank CPU times for the balance, and the
slowest rank's CPU time for what the step would take with a core per rank.
"""

from __future__ import annotations

import statistics
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_mgpu.models import Llama, LlamaConfig  # noqa: E402
from lightning_mgpu.parallel.context import apply_context_parallel, shard_sequence  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=768, vocab_size=1024,
                          max_seq_len=2048),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64))
SEQ, WARMUP, STEPS = sized((2048, 1, 4), (64, 0, 1))


def _rank(rank: int, size: int, balanced: bool) -> dict:
    dist.init_process_group("gloo")
    model = Llama(MODEL)
    if size > 1:
        apply_context_parallel(model, dist.group.WORLD, rank, size, balanced)
    tokens = torch.randint(0, MODEL.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = (shard_sequence(t, rank, size, balanced=balanced) for t in (tokens[:, :-1], tokens[:, 1:]))
    moved = [0]
    # What this rank sends in a ring: all of its input to each of the C - 1 others for an all-gather, (C - 1) / C of
    # its (whole-sequence) input for a reduce-scatter.
    for name, share in (("all_gather_single", size - 1), ("reduce_scatter_single", (size - 1) / size)):
        original = getattr(dist, name)

        def counted(out, inp, *a, _original=original, _share=share, **kw):
            moved[0] += inp.numel() * inp.element_size() * _share
            return _original(out, inp, *a, **kw)

        setattr(dist, name, counted)
    walls, cpus, volumes = [], [], []
    for step in range(WARMUP + STEPS):
        dist.barrier()
        moved[0] = 0
        wall, cpu = time.perf_counter(), time.process_time()
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        model.zero_grad(set_to_none=True)
        if step >= WARMUP:
            walls.append(wall)
            cpus.append(cpu)
            volumes.append(moved[0])
    dist.destroy_process_group()
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "bytes": volumes[-1]}


def main() -> None:
    print(f"Llama {MODEL.n_layers} blocks, dim {MODEL.dim}, {MODEL.n_heads} heads / {MODEL.n_kv_heads} kv heads; one "
          f"{SEQ}-token sequence; fp32, 1 thread per rank, forward + backward; median of {STEPS} steps")
    print(f"{'cp':>3} {'split':>10} {'step s':>7} {'CPU s per rank':>24} {'slowest/fastest':>15} "
          f"{'MB sent per rank':>16}")
    for size, balanced in sized(((1, True), (2, True), (2, False), (4, True), (4, False)), ((1, True), (2, True))):
        results = run_distributed(_rank, size, size, balanced, timeout=900)
        cpu = [r["cpu"] for r in results]
        split = "-" if size == 1 else ("balanced" if balanced else "contiguous")
        print(f"{size:>3} {split:>10} {max(r['wall'] for r in results):>7.2f} "
              f"{' '.join(f'{c:.2f}' for c in cpu):>24} {max(cpu) / min(cpu):>15.2f} "
              f"{results[0]['bytes'] / 1e6:>16.2f}")


if __name__ == "__main__":
    with recorded(__file__, "Context parallelism", about=__doc__):
        main()
