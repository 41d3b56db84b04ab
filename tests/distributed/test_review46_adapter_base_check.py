"""Review of issue 46: an adapter-only checkpoint leaves its frozen base out, and the issue asks that the base be
"named by its directory and checksum". Resuming it over another base must then be refused, naming both; today the
record holds the directory only and nothing compares it: the run below resumes LoRA trained over one base onto a base
of other weights and trains on without a word (the same from the command line: ``mgpu-train model=hf
model.path=OTHER ... checkpoint.resume=CKPT`` runs to the end)."""

import pytest
from hf_helpers import tiny_model
from helpers import in_turn

import peft_helpers
from lightning_mgpu.testing import run_distributed

pytest.importorskip("peft")


def resume_over(rank: int, devices: int, checkpoint: str, base: str) -> dict:
    try:
        peft_helpers.fit_adapted(rank, "lora", "llama", devices, steps=2, ckpt_path=checkpoint, zero_stage=1,
                                 lora=dict(base=base, targets=["q_proj", "v_proj"]))
    except Exception as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


def test_resuming_adapters_over_another_base_is_refused(tmp_path):
    import torch

    torch.manual_seed(1)
    tiny_model("llama").save_pretrained(tmp_path / "base")
    torch.manual_seed(2)
    tiny_model("llama").save_pretrained(tmp_path / "other")  # same architecture, other weights
    checkpoint = str(tmp_path / "ckpt")
    results = run_distributed(in_turn, 2, {
        "saved": (peft_helpers.fit_adapted, ("lora", "llama", 2), dict(
            steps=1, save_to=checkpoint, zero_stage=1, lora=dict(base=str(tmp_path / "base"), targets=["q_proj", "v_proj"]))),
        "resumed": (resume_over, (2, checkpoint, str(tmp_path / "other")), {})})
    raised = results[0]["resumed"]["raised"]
    assert raised is not None, "an adapter checkpoint resumed over a base of other weights without a refusal"
    assert "other" in raised and "base" in raised, raised[-2000:]
