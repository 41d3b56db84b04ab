"""Mixture of experts on CPU: tokens/s at expert parallel 1 and 2 over two data-parallel processes, and the all-to-all
bytes of a step measured against the planner's formula (``planner.experts.all_to_all_bytes``).

Each configuration runs forward + backward of the next-token loss of a 4-layer Llama with 8 experts (top-2) per layer
on two forked gloo processes with one thread each, ``STEPS`` steps after a warm-up; each process routes its own
batch. At expert parallel 2 each holds 4 experts of every layer and the tokens travel by all-to-all. Bytes are
counted at the dispatch and combine of the forward (what a rank sends to the other rank); backward sends the same
amount the other way, so a step's count is twice that.
"""

from __future__ import annotations

import statistics
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_mgpu.layout import ParallelLayout  # noqa: E402
from lightning_mgpu.models import Llama, LlamaConfig  # noqa: E402
from lightning_mgpu.parallel import experts  # noqa: E402
from lightning_mgpu.planner.experts import all_to_all_bytes  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=1024,
                          max_seq_len=512, num_experts=8, experts_per_token=2, expert_hidden=128),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                          num_experts=4, experts_per_token=2))
BATCH, SEQ, WARMUP, STEPS = sized((4, 256, 1, 5), (1, 32, 0, 1))


def _rank(rank: int, ep: int) -> dict:
    dist.init_process_group("gloo")
    layout = ParallelLayout(world_size=2, expert_parallel_size=ep)
    layout.init_groups(rank)
    model = Llama(MODEL)
    experts.apply_expert_parallel(model, layout)
    sent = [0]
    original = experts._all_to_all

    def counted(x, output_splits, input_splits, group):
        sent[0] += (sum(input_splits) - input_splits[dist.get_rank(group)]) * x[0].numel() * x.element_size() \
            if x.shape[0] else 0
        return original(x, output_splits, input_splits, group)

    experts._all_to_all = counted
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(WARMUP + STEPS):
        sent[0] = 0
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times[WARMUP:]), "bytes": 2 * sent[0]}


def main() -> None:
    tokens = 2 * BATCH * SEQ
    print(f"tiny MoE: {MODEL.n_layers} layers x {MODEL.num_experts} experts (top-{MODEL.experts_per_token}), "
          f"{BATCH} x {SEQ} tokens per process, 2 processes")
    for ep in (1, 2):
        results = run_distributed(_rank, 2, ep)
        seconds = max(r["seconds"] for r in results)
        measured = statistics.mean(r["bytes"] for r in results)
        formula = MODEL.n_layers * all_to_all_bytes(MODEL, BATCH * SEQ, ep, element_bytes=4)
        print(f"expert parallel {ep}: {tokens / seconds:,.0f} tokens/s ({seconds * 1e3:.0f} ms a step); all-to-all "
              f"{measured / 1e6:.3f} MB a step per rank, planner {formula / 1e6:.3f} MB")


if __name__ == "__main__":
    with recorded(__file__, "Mixture of experts on CPU", about=__doc__):
        main()
