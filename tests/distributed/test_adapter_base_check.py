"""An adapter-only checkpoint leaves its frozen base out and names it by its directory and the fingerprint of its
weights files (``lightning_mgpu.hf.adapters.base_fingerprint``): resuming it over a base of other weights is refused,
naming both (it trained on without a word before the check: ``mgpu-train model=hf model.path=OTHER ...
checkpoint.resume=CKPT`` ran to the end)."""

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

    tiny_model("llama").save_pretrained(tmp_path / "base")
    other = tiny_model("llama")  # same architecture (tiny_model seeds itself: the same weights until moved)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.01)
    other.save_pretrained(tmp_path / "other")
    checkpoint = str(tmp_path / "ckpt")
    results = run_distributed(in_turn, 2, {
        "saved": (peft_helpers.fit_adapted, ("lora", "llama", 2), dict(
            steps=1, save_to=checkpoint, zero_stage=1, lora=dict(base=str(tmp_path / "base"), targets=["q_proj", "v_proj"]))),
        "resumed": (resume_over, (2, checkpoint, str(tmp_path / "other")), {})})
    raised = results[0]["resumed"]["raised"]
    assert raised is not None, "an adapter checkpoint resumed over a base of other weights without a refusal"
    assert "other" in raised and "base" in raised, raised[-2000:]
