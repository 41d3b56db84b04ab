"""``HFCausalLM`` (the module ``mgpu-train`` builds for a ``transformers`` directory) under pipeline parallelism: its
pipeline loss on the last stage, over 2 micro-batches of 1F1B on 2 ranks, against one process running the same
directory's model on the same batches -- the mean next-token cross-entropy written here, the global grad norm before
clipping, torch's AdamW at a constant LR -- loss and grad norm each step within 1e-5.

It failed until ``HFCausalLM.pipeline_batch`` handed on contiguous targets: transformers' ``ForCausalLMLoss`` calls
``shift_labels.view(-1)``, which the view ``batch[:, 1:]`` refuses ("view size is not compatible with input tensor's
size and stride"), so ``mgpu-train model=hf`` with ``parallel.pipeline_parallel_size`` > 1 stopped at its first step."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_helpers import tiny_model, token_ids
from helpers import max_abs_diff
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.hf.module import HFCausalLM
from lightning_mgpu.testing import run_distributed

LR, CLIP, BATCH, STEPS = 1e-2, 0.3, 4, 3
BATCHES = token_ids(BATCH * STEPS, 17)  # [batch, seq + 1]: 16 inputs and their 16 next tokens a row


class Recorded(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.grad_norms.append(float(trainer.strategy.last_grad_norm))


def pipelined(rank: int, directory: str) -> dict:
    recorded = Recorded()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, gradient_clip_val=CLIP, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorded],
                        use_distributed_sampler=False,  # the rows in order, as the reference reads them
                        strategy=MGPUStrategy(pipeline_parallel_size=2, num_microbatches=2))
    # warmup 0 and max_steps 0: a constant LR (no schedule to write again in the reference)
    module = HFCausalLM(directory, lr=LR, weight_decay=0.0, warmup_steps=0, max_steps=0)
    trainer.fit(module, DataLoader(BATCHES, batch_size=BATCH))
    return {"losses": recorded.losses, "grad_norms": recorded.grad_norms, "pp": trainer.strategy.layout.rank("pp")}


def one_process(directory: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for batch in BATCHES.split(BATCH):
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    path = Path(tmp_path_factory.mktemp("llama"))
    tiny_model("llama").save_pretrained(path)
    return str(path)


def test_hf_causal_lm_pipeline_loss_matches_one_process(directory):
    results = run_distributed(pipelined, 2, directory)
    expected = one_process(directory)
    assert sorted(r["pp"] for r in results) == [0, 1]  # two stages ran
    for r in results:
        assert len(r["losses"]) == STEPS
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (r["grad_norms"], expected["grad_norms"])
