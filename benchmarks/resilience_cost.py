"""What failure handling costs a rank, per million parameters, in fp32 and bf16, on this machine's CPU (one thread, as
a rank of a CPU job runs):

- the step guard (``bad_steps.skip``, every step): the finiteness check of the gradients it is about to apply (one
  pass); its all-gather moves three numbers a rank;
- the silent-corruption check (``sdc.every_n_steps``): fingerprinting the rank's copy of the weights (one pass summing
  every element's bit pattern); its all-gather moves 8 bytes per parameter tensor. Divide by ``every_n_steps`` for
  the cost per step."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

from lightning_mgpu.resilience.fingerprint import fingerprints  # noqa: E402
from lightning_mgpu.resilience.step_guard import _gradients_finite  # noqa: E402

torch.set_num_threads(1)
#: a Llama-like set of tensors: (count, rows, columns); 8 blocks of 4096 x 4096-ish matrices in full
SHAPES = sized([(8 * 7, 2048, 2048)], [(4, 256, 256)])
ROUNDS = sized(5, 1)


def seconds_per_check(dtype: torch.dtype) -> tuple[float, float, int]:
    """(fingerprint seconds, gradient finiteness seconds, parameters): medians over the rounds."""
    params = [torch.randn(rows, cols).to(dtype) for count, rows, cols in SHAPES for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.SGD(params, lr=0.1)
    fingerprint, finite = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fingerprints(params)
        middle = time.perf_counter()
        _gradients_finite(optimizer)
        fingerprint.append(middle - start)
        finite.append(time.perf_counter() - middle)
    return statistics.median(fingerprint), statistics.median(finite), sum(p.numel() for p in params)


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        fingerprint, finite, n = seconds_per_check(dtype)
        name, millions = str(dtype).removeprefix("torch."), n / 1e6
        print(f"step guard {name}: gradients of {millions:.1f}M parameters checked in {finite * 1e3:.1f} ms = "
              f"{finite * 1e3 / millions:.3f} ms per million parameters")
        print(f"fingerprint {name}: {millions:.1f}M parameters in {fingerprint * 1e3:.1f} ms "
              f"= {fingerprint * 1e3 / millions:.3f} ms per million parameters")


if __name__ == "__main__":
    with recorded(__file__, "Step guard and silent corruption check", about=__doc__):
        main()
