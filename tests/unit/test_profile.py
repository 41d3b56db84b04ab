"""Profiles of chosen steps (``ProfileSteps``, ``mgpu-train profile.steps=[...]``) in one process: the profiler runs in
exactly the chosen optimizer steps (every batch of one under gradient accumulation) and in no other; a run without the
key adds no callback, so no step runs under a profiler; the memory file names the largest tensors. The multi-process
trace, with pipeline actions and collectives, is tested through ``mgpu-train`` in tests/cli/test_cli.py."""

import json
import shutil

import lightning as L
import torch
import torch.autograd.profiler as autograd_profiler
from cli_helpers import composed

from lightning_mgpu.callbacks.profile import ProfileSteps, merge_traces
from lightning_mgpu.cli.train import _callbacks


class Linear(L.LightningModule):
    """A linear layer; each batch records whether a profiler ran, under a label of its batch index."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.profiled: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.profiled.append(autograd_profiler._is_profiler_enabled)
        with torch.profiler.record_function(f"batch {batch_idx}"):
            return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.layer.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 64)), batch_size=2)


def fit(callbacks, max_steps=4, accumulate=2) -> Linear:
    module = Linear()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module)
    return module


def test_only_the_chosen_optimizer_steps_run_under_the_profiler(tmp_path):
    module = fit([ProfileSteps([1, 3], tmp_path)])
    # 4 optimizer steps of 2 batches each: steps 1 and 3 are batches 2, 3 and 6, 7
    assert module.profiled == [False, False, True, True, False, False, True, True]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")) == [
        "step1/rank0.memory.json", "step1/rank0.trace.json", "step3/rank0.memory.json", "step3/rank0.trace.json"]
    names = [e["name"] for e in json.loads((tmp_path / "step1" / "rank0.trace.json").read_text())["traceEvents"]]
    assert "ProfilerStep#1" in names and {"batch 2", "batch 3"} <= set(names)
    assert not {"batch 1", "batch 4"} & set(names)
    assert sum(n.startswith("Optimizer.step#Adam.step") for n in names) == 1  # the step's one update
    assert not autograd_profiler._is_profiler_enabled  # stopped after its last step


def test_without_profile_steps_no_callback_and_no_step_is_profiled(tmp_path):
    cfg = composed()
    assert list(cfg.profile.steps) == []
    assert not [c for c in _callbacks(cfg, tmp_path) if isinstance(c, ProfileSteps)]
    assert [c for c in _callbacks(composed("profile.steps=[2]"), tmp_path) if isinstance(c, ProfileSteps)]
    assert fit([]).profiled == [False] * 8


def test_the_memory_file_names_the_largest_tensors(tmp_path):
    # many: a pytest worker that ran other test files first may hold larger tensors of theirs, unnamed here
    fit([ProfileSteps([2], tmp_path, largest_tensors=10_000)], accumulate=1)
    memory = json.loads((tmp_path / "step2" / "rank0.memory.json").read_text())
    assert memory["step"] == 2 and memory["rank"] == 0
    assert memory["peak_resident_scope"] == "step"  # Linux: VmHWM reset when the step started
    assert 0 < memory["peak_resident_bytes"] <= memory["process_peak_resident_bytes"]
    assert memory["live_tensor_bytes"] >= sum(t["bytes"] for t in memory["largest_tensors"])
    # the weight (64 x 64 float32 = 16 KiB), its gradient and Adam's two moments are the module's largest, named
    largest = {t["name"]: t for t in memory["largest_tensors"] if t["name"].startswith("layer.")}
    assert set(list(largest)[:4]) == {"layer.weight", "layer.weight.grad", "layer.weight.exp_avg",
                                      "layer.weight.exp_avg_sq"}
    assert largest["layer.weight"] == {"name": "layer.weight", "shape": [64, 64], "dtype": "float32",
                                       "device": "cpu", "bytes": 64 * 64 * 4}


def test_merged_traces_show_each_rank_as_its_own_processes(tmp_path):
    fit([ProfileSteps([0], tmp_path)], max_steps=1, accumulate=1)
    step = tmp_path / "step0"
    shutil.copyfile(step / "rank0.trace.json", step / "rank1.trace.json")  # a second rank, with the same process id
    one = json.loads((step / "rank0.trace.json").read_text())["traceEvents"]
    merged = json.loads(merge_traces(step).read_text())["traceEvents"]
    assert len(merged) == 2 * len(one)
    names = sorted(e["args"]["name"] for e in merged if e.get("name") == "process_name")
    assert names[0].startswith("rank 0 ") and names[1].startswith("rank 1 ") and len(names) == 2
    pids = [{e["pid"] for e in merged[:len(one)] if "pid" in e}, {e["pid"] for e in merged[len(one):] if "pid" in e}]
    assert not pids[0] & pids[1] and max(pids[0]) < 1000 <= min(pids[1])
