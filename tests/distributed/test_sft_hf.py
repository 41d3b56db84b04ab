"""A ``transformers`` model as it is (``HFCausalLM``) on packed conversations: with ``eod_token_id`` each conversation
attends only to itself with positions restarting (a 4-D attention mask and ``position_ids``) and the model's own
``labels=`` loss divides by the global batch's answer count (``num_items_in_batch``). The reference runs every
conversation alone through the plain model, so it shares nothing with the mask or the count."""

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from chat_helpers import make_chat_tokenizer, short_conversations, write_jsonl
from helpers import Recorder, assert_parity, in_turn

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.data.sft import SFTDataModule
from lightning_mgpu.hf.module import HFCausalLM
from lightning_mgpu.testing import run_distributed

SEQ, GLOBAL, MICRO, SEED, STEPS, LR = 64, 8, 2, 7, 3, 1e-2


def data_module(path) -> SFTDataModule:
    return SFTDataModule(path, seq_len=SEQ, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=SEED,
                         val_fraction=0.05, val_batches=1)


def module(directory, eod: int) -> HFCausalLM:
    return HFCausalLM(str(directory), lr=LR, warmup_steps=2, max_steps=10, eod_token_id=eod)


def hf_fit(rank: int, path, directory, eod: int, devices: int = 2, **strategy) -> dict:
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy), precision="32-true",
                        max_steps=STEPS, gradient_clip_val=0.3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                        val_check_interval=STEPS, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        callbacks=[recorder])
    trainer.fit(module(directory, eod), data_module(path))
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "rank": rank,
            "val_loss": float(trainer.callback_metrics["val/loss"])}


def alone_loss(model, tokens: torch.Tensor, labels: torch.Tensor, eod: int) -> torch.Tensor:
    """Sum over the batch's answer targets of each conversation run alone, over their count."""
    total, count = 0.0, 0
    for ids, lab in zip(tokens, labels):
        inputs, targets = ids[:-1], lab[1:]
        ends = (inputs == eod).nonzero().flatten().tolist()
        for lo, hi in zip([0] + [e + 1 for e in ends], ends + [len(inputs)]):
            if hi <= lo or (targets[lo:hi] == -100).all():
                continue
            logits = model(input_ids=inputs[lo:hi][None]).logits[0]
            wanted = targets[lo:hi].masked_fill(inputs[lo:hi] == eod, -100)
            total = total + F.cross_entropy(logits, wanted, ignore_index=-100, reduction="sum")
            count += int((wanted != -100).sum())
    return total / count


def reference(path, directory, eod: int) -> dict:
    plain = module(directory, eod)
    plain.configure_model()
    configured = plain.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    packed = data_module(path).splits()[0]
    losses, norms = [], []
    for step in range(STEPS):
        loss = alone_loss(plain.llm, *packed.batch(SEED, step, GLOBAL, 0, GLOBAL), eod)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(plain.llm.parameters(), 0.3).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    held_out = data_module(path).splits()[1]  # the validation batch after the last step: seed + 1, its first
    with torch.no_grad():
        val = alone_loss(plain.llm, *held_out.batch(SEED + 1, 0, GLOBAL, 0, GLOBAL), eod).item()
    return {"losses": losses, "grad_norms": norms, "val_loss": val}


def test_a_transformers_model_on_packed_conversations_matches_each_run_alone_on_every_layout(tmp_path):
    """dp2, tp2 + SP, pp2, cp2 and tp2 x pp2 x dp2 (8 ranks, ZeRO-1). One to three conversations per packed sequence
    (28 of 75 hold two or three). Broken once each: without the attention mask and positions
    (document_arguments) the loss is 2.7e-3 off; without num_items_in_batch (the model's per-call mean) 3.6e-3."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", short_conversations(120))
    out = tmp_path / "sft"
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(out), str(data), "--workers", "1",
                  "--max-tokens", str(SEQ + 1), "--no-progress"])
    eod = data_module(out).splits()[0].pad_id
    torch.manual_seed(11)
    config = transformers.LlamaConfig(vocab_size=416, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa")
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    expected = reference(out, directory, eod)
    layouts = {"dp2": dict(zero_stage=1), "tp2": dict(tensor_parallel_size=2, sequence_parallel=True),
               "pp2": dict(pipeline_parallel_size=2), "cp2": dict(context_parallel_size=2)}
    runs = run_distributed(in_turn, 2, {name: (hf_fit, (out, directory, eod), layout)
                                        for name, layout in layouts.items()})
    for name in layouts:
        assert_parity([r[name] for r in runs], expected)
        assert all(abs(r[name]["val_loss"] - expected["val_loss"]) < 1e-5 for r in runs), (name, expected["val_loss"])
    three_d = dict(devices=8, tensor_parallel_size=2, sequence_parallel=True, pipeline_parallel_size=2, zero_stage=1)
    runs = run_distributed(in_turn, 8, {"3d": (hf_fit, (out, directory, eod), three_d)})
    assert_parity([r["3d"] for r in runs], expected)
    assert all(abs(r["3d"]["val_loss"] - expected["val_loss"]) < 1e-5 for r in runs), expected["val_loss"]
