"""Step time of causal attention against the document mask (``data.document_mask=true``) on CPU, side by side.

One process, one thread, fp32: forward, backward and AdamW of LLMModule's loss on packed samples with an end-of-document
token every 10-200 tokens, for a 4-block Llama (dim 256) at sequence 256 and 512. The two variants have the same
weights and data; they alternate step by step so that a slower moment of a shared machine costs both. Prints the
median step time of each and their ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

torch.set_num_threads(1)

from lightning_mgpu import LLMModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

EOD = 0
MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=1024,
                          max_seq_len=512),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=512))
BATCH, WARMUP, STEPS = sized((4, 2, 10), (1, 0, 1))


def packed_batch(seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[BATCH, seq_len + 1]`` random ids with EOD ending documents of 10-200 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, MODEL.vocab_size, (BATCH, seq_len + 1), generator=g)
    for row in tokens:
        at = int(torch.randint(10, 200, (1,), generator=g))
        while at < seq_len + 1:
            row[at] = EOD
            at += int(torch.randint(10, 200, (1,), generator=g))
    return tokens


def trainer(cfg: LlamaConfig):
    module = LLMModule(cfg, warmup_steps=0)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-4)

    def step(batch: torch.Tensor) -> float:
        start = time.perf_counter()
        module.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return step


def main() -> None:
    print(f"{MODEL.n_layers} blocks, dim {MODEL.dim}, batch {BATCH}, fp32, 1 thread; median of {STEPS} steps")
    print(f"{'seq':>5} {'causal ms':>10} {'document mask ms':>17} {'ratio':>6}")
    for seq in sized((256, 512), (256,)):
        batch = packed_batch(seq)
        steps = {"causal": trainer(MODEL), "mask": trainer(replace(MODEL, eod_token_id=EOD))}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(WARMUP + STEPS):
            for name, step in steps.items():
                took = step(batch)
                if i >= WARMUP:
                    times[name].append(took)
        causal, mask = (statistics.median(times[n]) * 1e3 for n in ("causal", "mask"))
        print(f"{seq:>5} {causal:>10.1f} {mask:>17.1f} {mask / causal:>6.2f}")


if __name__ == "__main__":
    with recorded(__file__, "Packed-document mask", about=__doc__):
        main()
