"""What the silent-corruption check covers, said and tested: with expert parallelism (4 data-parallel ranks, 2 expert
groups) a bit flipped in one rank's expert weight is named among that expert's data-parallel copies, one flipped in a
dense weight by the majority of the 4 copies; the startup line says what is compared over how many copies and that
the optimizer state (ZeRO 1-2's fp32 master weights included) is not; at one data-parallel copy it warns that nothing
is compared."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import GLOBAL_BATCH, OPTIM, fit
from moe_helpers import TINY_MOE
from test_lightning_conformance import LogLines

from lightning_mgpu import LLMModule
from lightning_mgpu.resilience import SilentCorruptionCheck
from lightning_mgpu.testing import run_distributed

FLIP_RANK, FLIP_STEP = 1, 1  # flipped as step 1 begins; the check (every 2 steps) runs as step 2 begins


class FlipOneBit(L.Callback):
    """On rank ``FLIP_RANK`` as step ``FLIP_STEP`` begins: bit 22 (the highest mantissa bit of fp32) of the first
    element of the first parameter whose name contains ``part``."""

    def __init__(self, part: str) -> None:
        self.part = part

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != FLIP_STEP or trainer.global_rank != FLIP_RANK:
            return
        name, param = next((n, p) for n, p in trainer.strategy.model.module.named_parameters() if self.part in n)
        with torch.no_grad():
            param.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 22)


def checked_fit(rank: int, token_file, devices: int, flip: str = "", **layout: Any) -> dict:
    check = SilentCorruptionCheck(every_n_steps=2)
    with LogLines() as log, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        fit(rank, token_file, devices, max_steps=3, callbacks=[check, *([FlipOneBit(flip)] if flip else [])],
            check_layout=False, module=LLMModule(TINY_MOE, **OPTIM, global_batch_size=GLOBAL_BATCH), **layout)
    found = check.corruption
    return {"ranks": found.ranks if found else None, "parameters": found.parameters if found else None,
            "said": [line for line in log.lines if "silent data corruption check" in line],
            "warned": [str(w.message) for w in warned if "silent data corruption check" in str(w.message)]}


@pytest.fixture(scope="module")
def four_ranks_ep2(token_file):
    """A flip in an expert weight, then one in the token embedding, at ep2 over 4 data-parallel ranks, ZeRO-0."""
    kw = dict(expert_parallel_size=2, zero_stage=0)
    return run_distributed(lambda rank: {part: checked_fit(rank, token_file, 4, part, **kw)
                                         for part in (".experts.", "tok_embeddings")}, 4)


def test_a_flipped_expert_weight_is_named_among_its_copies(four_ranks_ep2):
    # ep groups are consecutive ranks ({0, 1}, {2, 3}: docs/concepts/layout.md), so rank 1's experts are also held by
    # rank 3 alone: two copies, no majority, both named; only expert weights differ
    for result in four_ranks_ep2:
        experts = result[".experts."]
        assert experts["ranks"] == [1, 3], experts
        assert experts["parameters"] and all(".experts." in n for n in experts["parameters"]), experts["parameters"]
        dense = result["tok_embeddings"]  # four copies: the majority names rank 1 alone
        assert dense["ranks"] == [FLIP_RANK] and dense["parameters"] == ["model.tok_embeddings.weight"], dense
    said = four_ranks_ep2[0][".experts."]["said"]
    assert len(said) == 1 and " dense parameter tensors over 4 copies" in said[0] and \
        " expert parameter tensors over 2 copies" in said[0] and "never compared: optimizer state" in said[0], said
    assert four_ranks_ep2[0][".experts."]["warned"] == []


@pytest.fixture(scope="module")
def two_ranks(token_file):
    """One step each: tensor parallelism over both ranks (one data-parallel copy), then ZeRO-1 over 2 copies."""
    return run_distributed(lambda rank: {"tp2": checked_fit(rank, token_file, 2, tensor_parallel_size=2),
                                         "zero1": checked_fit(rank, token_file, 2, zero_stage=1)}, 2)


def test_what_the_check_covers_is_said_and_one_copy_is_warned(two_ranks):
    tp2, zero1 = two_ranks[0]["tp2"], two_ranks[0]["zero1"]
    assert tp2["ranks"] is None and zero1["ranks"] is None  # nothing flipped, nothing found
    assert len(tp2["warned"]) == 1 and "one data-parallel copy" in tp2["warned"][0] and \
        "compares nothing" in tp2["warned"][0] and "sdc.every_n_steps=null" in tp2["warned"][0], tp2
    assert zero1["warned"] == [] and len(zero1["said"]) == 1, zero1
    assert "over 2 copies" in zero1["said"][0] and "ZeRO-1's fp32 master weights" in zero1["said"][0], zero1["said"]
    assert two_ranks[1]["tp2"]["said"] == two_ranks[1]["tp2"]["warned"] == []  # rank 0 says it
