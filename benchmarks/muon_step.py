"""Muon against AdamW side by side, in one run: step time and optimizer-state memory of the same Llama at tensor
parallel 2 x data parallel 2, ZeRO-1, four CPU processes.

Muon's step (``lightning_mgpu.optim``) gathers each ZeRO partition and each tensor-parallel shard into whole matrices
and runs the Newton-Schulz iteration there (every rank of a split the same, redundantly); AdamW is elementwise on the
partition. Each optimizer is timed per step (forward, backward and step) after a warm-up, alternating in rounds so
that machine noise hits both; the state is what rank 0's optimizer holds (Muon: one momentum per matrix it steps,
AdamW's two moments for the rest; AdamW: two moments for everything). Prints the medians and their ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the parity check's reference and data

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from step_timer import QuietLLMModule, Timer  # noqa: E402
from record import recorded  # noqa: E402
from smoke import SMOKE, sized  # noqa: E402

DIM, LAYERS, HEADS, KV, FFN, VOCAB = sized((256, 4, 8, 4, 768, 256), (32, 2, 4, 2, 64, 64))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 12, 3, 2), (16, 4, 3, 1, 1))
LAYOUT = dict(tensor_parallel_size=2, zero_stage=1)
DEVICES = sized(4, 2)  # tp2 x dp2; the smoke run tp2 alone (half the processes on the suite's cores)
PARITY_LAYOUT = dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)
PARITY_STEPS = 10



def state_bytes(trainer: L.Trainer) -> int:
    """Bytes of optimizer state (momenta, moments) this rank holds."""
    state = trainer.strategy.model.optimizer.optimizer.state
    return sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items()
               if torch.is_tensor(t) and k != "step")


def timed(rank: int, optimizer: str) -> tuple[list[float], int]:
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=MGPUStrategy(**LAYOUT), max_steps=STEPS + 1,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    module = QuietLLMModule(LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV, ffn_hidden=FFN,
                               vocab_size=VOCAB, max_seq_len=SEQ + 1), lr=1e-3, warmup_steps=1, optimizer=optimizer)
    tokens = torch.randint(0, VOCAB, (BATCH * (DEVICES // 2) * (STEPS + 1), SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    trainer.fit(module, train_dataloaders=DataLoader(tokens, batch_size=BATCH))
    return timer.times[WARMUP:], state_bytes(trainer)


def parity_rank(rank: int, token_file: Path) -> dict:
    from helpers import GLOBAL_BATCH, OPTIM, TINY, fit

    module = LLMModule(TINY, **dict(OPTIM, optimizer="muon"), global_batch_size=GLOBAL_BATCH)
    return fit(rank, token_file, 8, max_steps=PARITY_STEPS, module=module, **PARITY_LAYOUT)


def parity() -> None:
    """The layout the suite leaves out (8 processes): Muon at tp2 x pp2 x dp2 against one process, 10 steps."""
    import tempfile

    from helpers import OPTIM, make_token_file, max_abs_diff, reference

    with tempfile.TemporaryDirectory() as directory:
        token_file = make_token_file(Path(directory))
        want = reference(token_file, steps=PARITY_STEPS, optim=dict(OPTIM, optimizer="muon"))
        got = run_distributed(parity_rank, 8, token_file)
    losses = max(max_abs_diff(r["losses"], want["losses"]) for r in got)
    norms = max(max_abs_diff(r["grad_norms"], want["grad_norms"]) for r in got)
    print(f"tp2 x pp2 x dp2 ZeRO-1 against one process over {PARITY_STEPS} steps: loss {losses:.1e}, "
          f"grad norm {norms:.1e}")


def main() -> None:
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    state: dict[str, int] = {}
    for _ in range(ROUNDS):
        for name in times:
            steps, state[name] = run_distributed(timed, DEVICES, name)[0]
            times[name] += steps
    adamw, muon = (statistics.median(times[k]) for k in ("adamw", "muon"))
    print(f"median step on {DEVICES} CPU processes, tp2 x dp{DEVICES // 2}, ZeRO-1, {DIM}-wide {LAYERS}-layer Llama: "
          f"AdamW {adamw * 1e3:.1f} ms, Muon {muon * 1e3:.1f} ms")
    print(f"optimizer state on rank 0: AdamW {state['adamw'] / 1e6:.3f} MB, Muon {state['muon'] / 1e6:.3f} MB")
    print(f"ratio Muon / AdamW: {muon / adamw:.3f} (goal <= 1.2)")
    if not SMOKE:
        parity()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "Muon against AdamW", about=__doc__):
        main()
