"""Supervised fine-tuning on packed conversations (``mgpu-prepare --chat``, ``SFTDataModule``): the loss is the mean
over the global batch's answer tokens, so data-parallel ranks with unequal answer counts, tensor, pipeline and
context parallelism all give one process's loss and gradient norm (fp32, within 1e-5)."""

from dataclasses import replace

import lightning as L
import torch
import torch.nn.functional as F
from chat_helpers import make_chat_tokenizer, short_conversations, write_jsonl
from helpers import OPTIM, TINY, Recorder, assert_parity, configured_optimizer, in_turn

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.data.sft import SFTDataModule
from lightning_mgpu.module import LLMModule
from lightning_mgpu.testing import run_distributed

SEQ, GLOBAL, MICRO, SEED, STEPS = 64, 8, 2, 7, 3


def data_module(path) -> SFTDataModule:
    return SFTDataModule(path, seq_len=SEQ, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=SEED,
                         val_fraction=0.05, val_batches=1)


def sft_fit(rank: int, path, devices: int, model, **strategy) -> dict:
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy), precision="32-true",
                        max_steps=STEPS, gradient_clip_val=0.3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[recorder])
    trainer.fit(LLMModule(model, **OPTIM, global_batch_size=GLOBAL), data_module(path))
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "rank": rank}


def reference(path, model) -> dict:
    """One process, whole global batches: cross entropy averaged over every answer target of the batch (the labels'
    -100 and the target after an end-of-document token skipped), written without LLMModule's loss."""
    module = LLMModule(model, **OPTIM, global_batch_size=GLOBAL)
    module.configure_model()
    optimizer, scheduler = configured_optimizer(module)
    packed = data_module(path).splits()[0]
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = packed.batch(SEED, step, GLOBAL, 0, GLOBAL)
        targets = labels[:, 1:].masked_fill(tokens[:, :-1] == model.eod_token_id, -100)
        loss = F.cross_entropy(module.model(tokens[:, :-1]).flatten(0, 1), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(module.model.parameters(), 0.3).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


def test_answer_token_mean_matches_one_process_at_dp2_tp2_pp2_cp2_and_3d(tmp_path):
    """Broken once: each rank dividing by its own answer count (LLMModule._tokens_per_microbatch without the sum over
    replicas, each rank's own mean averaged) fails dp2: loss 7.1e-4 off."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", short_conversations(120))
    out = tmp_path / "sft"
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(out), str(data), "--workers", "1",
                  "--max-tokens", str(SEQ + 1), "--no-progress"])
    packed = data_module(out).splits()[0]
    halves = [(packed.batch(SEED, 0, GLOBAL, lo, lo + GLOBAL // 2)[1][:, 1:] != -100).sum().item()
              for lo in (0, GLOBAL // 2)]
    assert halves[0] != halves[1], halves  # the two data ranks count different numbers of answer tokens
    eod = packed.pad_id
    model = replace(TINY, vocab_size=416, eod_token_id=eod, n_layers=2)
    expected = reference(out, model)
    layouts = {"dp2": dict(zero_stage=1), "tp2": dict(tensor_parallel_size=2, sequence_parallel=True),
               "pp2": dict(pipeline_parallel_size=2), "cp2": dict(context_parallel_size=2)}
    calls = {name: (sft_fit, (out, 2, model), layout) for name, layout in layouts.items()}
    runs = run_distributed(in_turn, 2, calls)
    for name in layouts:
        assert_parity([r[name] for r in runs], expected)
    three_d = dict(tensor_parallel_size=2, sequence_parallel=True, pipeline_parallel_size=2, zero_stage=1)
    runs = run_distributed(in_turn, 8, {"3d": (sft_fit, (out, 8, model), three_d)})
    assert_parity([r["3d"] for r in runs], expected)
