"""``model.compile`` on CPU: compile time and step time with and without compiling the blocks.

One process, one thread, fp32, a 4-block Llama (dim 256, 8 heads / 2 key-value heads, ffn 768) on 4 x 256-token
micro-batches: forward + backward + AdamW of ``LLMModule``'s loss. For each activation-checkpointing mode, eager and
``inductor`` (with an empty compile cache, so the first step includes the whole compilation): the first step's time
and the median of the next ``STEPS``. ``--cuda`` runs the same on the GPU in bf16 (``make gpu-check``); ``--smoke`` a
tiny model with ``aot_eager``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")  # before torch compiles anything

import torch  # noqa: E402

torch.set_num_threads(1)

from lightning_mgpu import LLMModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from record import recorded  # noqa: E402
from smoke import SMOKE, sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=768, vocab_size=1024,
                          max_seq_len=256),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=32))
BATCH, SEQ, STEPS = sized((4, 256, 8), (1, 16, 1))
CUDA = "--cuda" in sys.argv[1:]
DEVICE, DTYPE = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
#: the smoke mode traces with aot_eager (no generated code, no compiler needed) instead of inductor
BACKEND = "aot_eager" if SMOKE else "inductor"


def run(cfg: LlamaConfig) -> tuple[float, float]:
    """(first step's seconds, median of the next STEPS)."""
    module = LLMModule(cfg, warmup_steps=0)
    module.configure_model()
    module.model.to(DEVICE, DTYPE).train()
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-4)
    batch = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        module.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main() -> None:
    print(f"{MODEL.n_layers} blocks, dim {MODEL.dim}, batch {BATCH} x {SEQ}, {DEVICE}, {DTYPE}, 1 thread")
    print(f"{'checkpointing':>13} {'eager step s':>12} {'compiled first step s':>22} {'compiled step s':>16} "
          f"{'speed-up':>8}")
    for mode in sized(("none", "selective", "full"), ("none",)):
        _, eager = run(replace(MODEL, activation_checkpointing=mode))
        first, compiled = run(replace(MODEL, activation_checkpointing=mode, compile=True, compile_backend=BACKEND))
        print(f"{mode:>13} {eager:>12.3f} {first:>22.1f} {compiled:>16.3f} {eager / compiled:>8.2f}")


if __name__ == "__main__":
    with recorded(__file__, "Compiled blocks", about=__doc__, when=not CUDA):
        main()
