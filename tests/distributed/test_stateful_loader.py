"""A plain LightningModule's own torchdata ``StatefulDataLoader`` resumes mid-epoch exactly under MGPUStrategy: after
a checkpoint written at step 5 of an epoch of 8, the resumed run's ranks see the samples the uninterrupted run's ranks
saw from step 6 on, each its own (data-parallel ranks are not world ranks under tensor parallelism). A plain
``DataLoader`` starts its epoch again, which the contrast case shows."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from helpers import SaveAtStep, in_turn
from test_bring_your_own_model import GPTModule

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.testing import run_distributed

SAMPLES, BATCH, SAVE_AT, STEPS = 64, 4, 5, 11  # 2 data-parallel ranks: 8 batches an epoch; the epoch ends at 8


class Windows(Dataset):
    """Map-style: item i is (i, 17 seeded token ids); the index tells a test who saw what."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (SAMPLES, 17), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.tokens[i]


class GPTOnOwnLoader(GPTModule):
    """The GPT of the bring-your-own-model test (with its tensor-parallel plan), fed by its own loader; records the
    sample indices of every training batch on this rank."""

    def __init__(self, stateful: bool, own_shards: bool) -> None:
        super().__init__()
        self.stateful, self.own_shards, self.seen = stateful, own_shards, []

    def train_dataloader(self) -> DataLoader:
        kind = StatefulDataLoader if self.stateful else DataLoader
        data = self.trainer.distributed_sampler_kwargs  # this rank's place among the data-parallel ranks
        if self.own_shards:  # every data rank its own shard and shuffling generator: their loader states differ
            shard = Subset(Windows(), range(data["rank"], SAMPLES, data["num_replicas"]))
            generator = torch.Generator().manual_seed(100 + data["rank"])
            return kind(shard, batch_size=BATCH, shuffle=True, generator=generator)
        # the shard of a DistributedSampler, in an order fixed by seed and epoch (what the how-to prescribes)
        sampler = DistributedSampler(Windows(), shuffle=True, seed=0, **data)
        return kind(sampler.dataset, batch_size=BATCH, sampler=sampler)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        indices, tokens = batch
        self.seen.append(indices.tolist())
        return super().training_step(tokens, batch_idx)


def fits(rank: int, tmp: str, stateful: bool, own_shards: bool = False, **strategy: Any) -> dict:
    """The uninterrupted run (writing a checkpoint after step SAVE_AT), then a run resumed from that checkpoint."""
    def trainer(callbacks: list) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=4 if strategy else 2, strategy=MGPUStrategy(**strategy),
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
                         use_distributed_sampler=not own_shards)

    L.seed_everything(0)
    whole = GPTOnOwnLoader(stateful, own_shards)
    trainer([SaveAtStep(SAVE_AT, f"{tmp}/ckpt")]).fit(whole)
    L.seed_everything(0)
    resumed = GPTOnOwnLoader(stateful, own_shards)
    trainer([]).fit(resumed, ckpt_path=f"{tmp}/ckpt")
    return {"whole": whole.seen, "resumed": resumed.seen}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The runs of 2 ranks, a StatefulDataLoader's and a plain DataLoader's, in one launch: name -> each rank's."""
    root = tmp_path_factory.mktemp("loaders")
    results = run_distributed(in_turn, 2, {"stateful": (fits, (str(root / "stateful"), True), {}),
                                           "plain": (fits, (str(root / "plain"), False), {})})
    return {name: [r[name] for r in results] for name in ("stateful", "plain")}


@pytest.mark.parametrize("strategy", [{}, dict(tensor_parallel_size=2, own_shards=True)],
                         ids=["dp2_distributed_sampler", "tp2_dp2_own_shards"])
def test_stateful_dataloader_resumes_with_the_next_samples(two_ranks, tmp_path, strategy):
    results = run_distributed(fits, 4, str(tmp_path), True, **strategy) if strategy else two_ranks["stateful"]
    data_ranks = [results[0], results[2]] if strategy else results  # tp2: ranks 0-1 are data rank 0, 2-3 rank 1
    # A DistributedSampler orders each epoch by seed and epoch: exact to the end. A loader's own shuffling generator
    # is restored by torchdata (0.11) for the rest of its epoch only; the next epochs are drawn differently (as in one
    # process without Lightning), so the own-shards case compares the rest of the epoch.
    exact_to = STEPS if not strategy else 8
    for r in results:
        assert len(r["whole"]) == STEPS and r["resumed"][:exact_to - SAVE_AT] == r["whole"][SAVE_AT:exact_to]
    if strategy:  # the tensor-parallel peers read the same batches
        assert results[0]["whole"] == results[1]["whole"] and results[2]["whole"] == results[3]["whole"]
    first_epoch = [sorted(i for batch in r["whole"][:8] for i in batch) for r in data_ranks]
    assert sorted(first_epoch[0] + first_epoch[1]) == list(range(SAMPLES))  # the two data ranks split the epoch


def test_a_plain_dataloader_starts_its_epoch_again(two_ranks):
    results = two_ranks["plain"]
    for r in results:
        # the resumed run replays the epoch from its first batch: what the uninterrupted run saw at steps 1-3
        assert r["resumed"][:3] == r["whole"][:3] and r["resumed"] != r["whole"][SAVE_AT:]
