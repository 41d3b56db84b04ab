"""Muon on every layout: each weight matrix orthogonalised whole, so that a run equals one process of the same
optimizer, whatever splits its matrices (tensor parallelism, ZeRO 1-3 partitions, pipeline stages, experts).

One chain of runs over five layouts (two steps each, each resuming the universal checkpoint the previous one wrote:
Muon's momentum is resharded like Adam's moments) of ``LLMModule(optimizer="muon")`` against one process of the same
ten steps stepped by ``torch.optim.Muon`` and ``torch.optim.AdamW`` as the test builds them (``tests/muon_reference.py``:
the package's ``MuonWithAdamW`` is what is tested, never the reference); a plain LightningModule whose
``configure_optimizers`` returns ``torch.optim.Muon`` against a plain PyTorch loop of ``torch.optim.Muon``. Without
the whole-matrix gather each tensor-parallel rank orthogonalises its own shard: the chain's tp2 segment then differs
from one process by 4e-4 in loss and the plain tp2 run by 0.05 in a weight (seen once by treating each shard as
whole). A changed default of ``MuonWithAdamW`` fails here: Newton-Schulz steps 5 -> 4 in ``MUON_DEFAULTS`` (tried
once) fails the chain's first segment."""

from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import GLOBAL_BATCH, OPTIM, TINY, assert_parity, datamodule, fit, in_turn, reference
from hf_helpers import fit_hf, global_batches, single_process
from moe_helpers import TINY_MOE, moe_reference
from muon_reference import torch_muon_and_adamw
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.callbacks import PeriodicCheckpoint, newest_checkpoint
from lightning_mgpu.optim.muon import _newton_schulz
from lightning_mgpu.testing import run_distributed

STEPS = 2  # per segment
CHAIN = [
    dict(devices=2, zero_stage=1),
    dict(devices=2, tensor_parallel_size=2, sequence_parallel=True, zero_stage=3),
    dict(devices=2, pipeline_parallel_size=2, zero_stage=1),
    dict(devices=2, context_parallel_size=2, zero_stage=2),
    dict(devices=4, tensor_parallel_size=2, zero_stage=1),
]
#: fp32 Newton-Schulz: torch's bf16 iteration is a step function of its input, so gradients summed in another order
#: drift apart by about 1e-5 in 10 steps (lightning_mgpu.optim.muon.orthogonalize), which would hide a real error
MUON = dict(OPTIM, optimizer="muon", muon_ns_dtype="float32", max_steps=STEPS * len(CHAIN))


def segment(rank, token_file, devices, directory, max_steps, ckpt_path, **layout):
    module = LLMModule(TINY, **MUON, global_batch_size=GLOBAL_BATCH)
    return fit(rank, token_file, devices, max_steps=max_steps, ckpt_path=ckpt_path, module=module,
               callbacks=[PeriodicCheckpoint(directory, every_n_steps=STEPS, keep_last=1)], **layout)


def segments(rank, token_file, devices, directory, indices):
    """The chain's segments ``indices`` (one world size) in turn on this rank, each resuming the newest checkpoint in
    ``directory``; each one's result."""
    out = []
    for i in indices:
        layout = dict(CHAIN[i])
        layout.pop("devices")
        if torch.distributed.is_initialized():  # every rank sees the checkpoint the segment before published
            torch.distributed.barrier()
        resume = newest_checkpoint(directory)
        out.append(segment(rank, token_file, devices, directory, (i + 1) * STEPS,
                           None if resume is None else str(resume), **layout))
    return out


class Chain(list):
    """Each segment's results, the directory of the checkpoints they wrote, and what the other tests of 2 ranks ran
    in the launch of the chain's 2-rank segments (``others``: name -> each rank's result)."""

    directory = None
    others: dict = {}


@pytest.fixture(scope="module")
def chain(token_file, tmp_path_factory):
    """The chain's segments of 2 ranks (the first four) in one launch, with every other run of 2 ranks of this file
    after them; then the last segment's 4 ranks."""
    results = Chain()
    results.directory = directory = tmp_path_factory.mktemp("muon")
    two = [i for i, layout in enumerate(CHAIN) if layout["devices"] == 2]
    assert two == list(range(len(two))), "the chain's 2-rank segments come first"
    calls = {"chain": (segments, (token_file, 2, directory, two), {}), **others(token_file)}
    first = run_distributed(in_turn, 2, calls)
    results.extend([r["chain"][k] for r in first] for k in range(len(two)))
    results.others = {name: [r[name] for r in first] for name in calls if name != "chain"}
    for i in range(len(two), len(CHAIN)):
        devices = CHAIN[i]["devices"]
        results.append([r[0] for r in run_distributed(segments, devices, token_file, devices, directory, [i])])
    return results


def test_muon_equals_one_process_on_every_layout_and_resumes_across_them(chain, token_file):
    ref = reference(token_file, steps=STEPS * len(CHAIN), optim=MUON, optimizers=torch_muon_and_adamw)
    assert ref["losses"][-1] < ref["losses"][0] - 0.2  # it learns: the comparison means something
    for i, results in enumerate(chain):
        steps = range(i * STEPS, (i + 1) * STEPS)
        assert_parity(results, {k: [ref[k][s] for s in steps] for k in ("losses", "grad_norms")}, tol=2e-6)


def evaluate_and_switch(rank, token_file, checkpoint):
    """Validate from the chain's last Muon checkpoint (an engine that evaluates reads weights alone), then try to
    resume it under AdamW (refused: the checkpoint holds Muon's momentum, not Adam's moments)."""
    module = LLMModule(TINY, **MUON, global_batch_size=GLOBAL_BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(zero_stage=1), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=1, max_steps=STEPS * len(CHAIN) + 1)
    val = trainer.validate(module, datamodule(token_file), ckpt_path=checkpoint)[0]["val/loss"]
    try:
        trainer.fit(LLMModule(TINY, **dict(MUON, optimizer="adamw"), global_batch_size=GLOBAL_BATCH),
                    datamodule(token_file), ckpt_path=checkpoint)
    except ValueError as error:
        return val, str(error)
    return val, None


def test_a_muon_checkpoint_validates_and_refuses_another_optimizer(chain, token_file):
    checkpoint = str(newest_checkpoint(chain.directory))
    for val, refusal in run_distributed(evaluate_and_switch, 2, token_file, checkpoint):
        assert 0 < val < 5
        assert refusal is not None and "holds no optimizer state 'exp_avg'" in refusal and "Muon" in refusal, refusal


class Bound(L.Callback):
    def on_train_end(self, trainer, module):
        optimizer = trainer.strategy.model.optimizer.optimizer
        stepped = [t for g in optimizer.param_groups if g.get("muon") for t in g["params"]]
        self.kinds = sorted({type(optimizer.matrices_of(t)).__name__ for t in stepped})


def bf16_shards(rank, token_file):
    bound = Bound()
    fit(rank, token_file, 2, max_steps=2, precision="bf16-mixed", callbacks=[bound],
        module=LLMModule(TINY, **MUON, global_batch_size=GLOBAL_BATCH), tensor_parallel_size=2, zero_stage=0)
    return bound.kinds


def experts(rank, token_file):
    module = LLMModule(TINY_MOE, **MUON, global_batch_size=GLOBAL_BATCH)
    return fit(rank, token_file, 2, max_steps=3, module=module, check_layout=False, expert_parallel_size=2,
               zero_stage=3)


PLAIN = {"zero3": dict(zero_stage=3), "tp2": dict(tensor_parallel_size=2, zero_stage=1)}


def others(token_file) -> dict:
    """The runs of 2 ranks of the tests below the chain's, for the chain's first launch."""
    calls = {"bf16_shards": (bf16_shards, (token_file,), {}), "experts": (experts, (token_file,), {}),
             "hf": (fit_hf, ("llama", 2), dict(steps=3, optimizer="muon", tensor_parallel_size=2, zero_stage=1))}
    calls.update({f"plain_{name}": (plain_run, (layout, 4), {}) for name, layout in PLAIN.items()})
    return calls


def test_tensor_parallel_shards_at_zero0_in_bf16_are_assembled(chain):
    """bf16 at ZeRO-0: DeepSpeed's unfused optimizer steps fp32 clones of the parameters; each split weight's clone is
    known as a tensor-parallel shard (unknown tensors are refused, never taken as whole)."""
    assert chain.others["bf16_shards"] == [["TensorParallelShard"]] * 2


def test_stacked_experts_are_orthogonalised_one_matrix_each(chain, token_file):
    """ep2 at ZeRO-3: each rank holds half the experts, each expert's matrices partitioned over its data ranks."""
    ref = moe_reference(token_file, 3, optim=MUON, optimizers=torch_muon_and_adamw)
    assert_parity(chain.others["experts"], ref, tol=2e-6)


def test_a_hugging_face_model_as_it_is_with_muon(chain):
    """A ``transformers`` Llama in a plain LightningModule, its plan from its own config, Muon on its blocks'
    matrices: tp2 x dp1 at ZeRO-1 against a plain loop of the same optimizer over the same batches."""
    results = chain.others["hf"]
    want = single_process("llama", global_batches(results), optimizer="muon")
    assert_parity(results, want, tol=2e-6)


class Net(L.LightningModule):
    """What a Lightning user writes: bias-free linear layers and ``torch.optim.Muon`` with an LR schedule."""

    def __init__(self, plan: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False), nn.ReLU(),
                                 nn.Linear(32, 4, bias=False))
        self.plan = {"net.0": "colwise_enter", "net.2": "rowwise"} if plan else None
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def tensor_parallel_plan(self):
        return self.plan

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.Muon(self.net.parameters(), lr=0.05, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def samples(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(torch.randn(n, 16, generator=g) + F.one_hot(y, 16).float(), y)


def plain_run(rank, layout, steps):
    """(the trained weights, each step's global batch: the data ranks' batches together)."""
    from lightning_mgpu import MGPUStrategy

    tp = layout.get("tensor_parallel_size", 1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(**layout), max_steps=steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    module = Net(plan=tp > 1)
    with _no_scheduler_warning():
        trainer.fit(module, DataLoader(samples(), batch_size=16 // (2 // tp)))
    batches = []
    for x, y in module.seen:
        xs, ys = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(y) for _ in range(2)]
        torch.distributed.all_gather(xs, x)
        torch.distributed.all_gather(ys, y)
        batches.append((torch.cat(xs[::tp]), torch.cat(ys[::tp])))  # tensor-parallel ranks share their batch
    return {"weight": _whole_weight(module, tp), "batches": batches}


def _whole_weight(module, tp):
    """The last split layer's weight, whole (under tp2 each rank holds half its columns)."""
    from lightning_mgpu.engine import gathered

    param = module.net[2].weight
    with gathered([param]):
        shard = param.detach().clone()
    if tp == 1:
        return shard
    pieces = [torch.empty_like(shard) for _ in range(2)]
    torch.distributed.all_gather(pieces, shard)
    return torch.cat(pieces, dim=1)


class _no_scheduler_warning:
    """The swapped step keeps its LR scheduler quiet ('step() before optimizer.step()', 'overridden')."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        schedule = [str(w.message) for w in self.seen if "optimizer.step()" in str(w.message)]
        assert not schedule, schedule


def plain_reference(batches) -> torch.Tensor:
    """One process, plain PyTorch: the same global batches, torch.optim.Muon and its schedule."""
    module = Net()
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    for x, y in batches:
        F.cross_entropy(module.net(x), y).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return module.net[2].weight.detach()


@pytest.mark.parametrize("layout", PLAIN)
def test_plain_module_returning_torch_muon(chain, layout):
    """The run that failed ("Param gradient must be a 2D matrix" at ZeRO 1-3) or silently differed (tp2, each rank
    orthogonalising its own shard) before: torch's own Muon, bf16 Newton-Schulz, against a plain loop of it, in the
    weights after 4 steps (its loss does not see Muon's update until the second step)."""
    got = chain.others[f"plain_{layout}"]
    want = plain_reference(got[0]["batches"])
    for rank in got:
        assert (rank["weight"] - want).abs().max() < 1e-5, (rank["weight"] - want).abs().max()
    assert (want - Net().net[2].weight).abs().max() > 1e-2  # it trained


def test_newton_schulz_in_bf16_is_torchs_own():
    """The fp32 iteration is written here (torch's fixes bf16): in bf16 it computes torch's bits."""
    from torch.optim import _muon as torch_muon

    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    want = torch_muon._zeropower_via_newtonschulz(g, coefficients, 5, 1e-7)
    assert torch.equal(_newton_schulz(g.bfloat16(), coefficients, 5, 1e-7), want)
