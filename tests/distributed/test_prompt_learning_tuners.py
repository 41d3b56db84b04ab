"""PEFT's prompt-learning tuners (prompt tuning, prefix tuning) under pipeline and tensor parallelism: each case is
refused naming the tuner (``lightning_mgpu.hf.adapters.prompt_learning_problems``), or equals one process (loss and
gradient norm within 1e-5). Without the refusal, at pp2 (1F1B) both tuners trained at losses that were not one
process's (the pipeline stages run the base model's layers, never ``PeftModelForCausalLM.forward``, which prepends the
virtual tokens: the losses were the base model's), and prefix tuning at tp2 died in the attention with "Sizes of
tensors must match" (its cached keys and values span every head)."""

import functools

import pytest
import torch
from hf_helpers import global_batches, tiny_model
from helpers import in_turn, max_abs_diff

import peft_helpers
from lightning_mgpu.testing import run_distributed

peft = pytest.importorskip("peft")

TUNERS = {"prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
          "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}
#: What a refusal names, per tuner.
NAMES = {"prompt": ("PromptTuning", "prompt tuning"), "prefix": ("PrefixTuning", "prefix tuning")}
LAYOUTS = {"pp2": dict(pipeline_parallel_size=2, num_microbatches=2), "tp2": dict(tensor_parallel_size=2)}


def build(kind: str, family: str, n_layers: int, **lora) -> torch.nn.Module:
    """The tiny model under PEFT's prompt-learning tuner ``kind`` (its virtual tokens drawn after seed 5)."""
    torch.manual_seed(5)
    return peft.get_peft_model(tiny_model(family, n_layers), TUNERS[kind]())


def fit_tuned(rank: int, kind: str, devices: int, **kw) -> dict:
    peft_helpers.build = build  # this rank's AdaptedLM builds the tuner (forked: the test process keeps its own)
    try:
        return peft_helpers.fit_adapted(rank, kind, "llama", devices, **kw)
    except Exception as error:  # a refusal is a result: its message is checked
        return {"raised": f"{type(error).__name__}: {error}"}


@functools.cache
def launch(layout: str) -> list[dict]:
    """Both tuners at ``layout``, in one launch of 2 ranks."""
    return run_distributed(in_turn, 2, {kind: (fit_tuned, (kind, 2), dict(steps=2, **LAYOUTS[layout])) for kind in TUNERS})


def reference(kind: str, batches: list[torch.Tensor]) -> dict:
    """One process: the same model and SGD loop as peft_helpers.single_process_adapted."""
    model = build(kind, "llama", 2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=peft_helpers.LORA_LR)
    losses, norms = [], []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, peft_helpers.CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(TUNERS))
def test_a_prompt_learning_tuner_is_refused_by_name_or_trains_as_in_one_process(kind, layout):
    results = [r[kind] for r in launch(layout)]
    raised = [r["raised"] for r in results if "raised" in r]
    if raised:
        assert any(name in message for message in raised for name in NAMES[kind]), raised[0][-2000:]
        return
    expected = reference(kind, global_batches(results))
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (r["grad_norms"], expected["grad_norms"])
