"""The planner's model-state bytes (parameters + gradients + optimizer state + DeepSpeed's buffers) against what
each rank really holds, for data, tensor and pipeline parallelism and ZeRO 0-3, to 5%."""

from pathlib import Path

import lightning as L
import pytest
from helpers import MeasureBeforeSecondStep, in_turn, make_token_file

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner import rank_parameters
from lightning_mgpu.planner.model_stats import rank_parameter_split
from lightning_mgpu.planner.memory import rank_model_state_bytes
from lightning_mgpu.testing import live_tensor_bytes, run_distributed

MODEL = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1024, vocab_size=256, max_seq_len=64)


def measure(rank, token_file, devices, precision, kw, optimizer="adamw"):
    before = live_tensor_bytes()  # the model does not exist yet: it is built in configure_model
    callback = MeasureBeforeSecondStep()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**kw), precision=precision,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[callback])
    data = TokenFileDataModule(token_file, seq_len=16, global_batch_size=4, micro_batch_size=1, seed=0,
                               val_fraction=0.1)
    trainer.fit(LLMModule(MODEL, optimizer=optimizer), data)
    layout = trainer.strategy.layout
    local = None if layout.zero_stage == 3 else sum(p.numel() for p in trainer.strategy.model.module.parameters())
    return callback.bytes - before, local, layout.rank("pp")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_token_file(Path(tmp_path_factory.mktemp("tokens")), n_tokens=20_000, vocab=256)


CASES = {
    "dp2-z0": (2, "32-true", dict(zero_stage=0), "adamw"),
    "dp2-z2": (2, "32-true", dict(zero_stage=2), "adamw"),
    "dp2-z3": (2, "32-true", dict(zero_stage=3), "adamw"),
    "dp2-z1-bf16": (2, "bf16-mixed", dict(zero_stage=1), "adamw"),
    "dp4-z3-bf16": (4, "bf16-mixed", dict(zero_stage=3), "adamw"),
    "tp2dp2-z2-bf16": (4, "bf16-mixed", dict(tensor_parallel_size=2, zero_stage=2), "adamw"),
    "pp2dp2-z1": (4, "32-true", dict(pipeline_parallel_size=2, zero_stage=1), "adamw"),
    # one momentum per matrix where Adam keeps two moments: 18% less model state per rank here (the planner says)
    "tp2dp2-z1-muon": (4, "bf16-mixed", dict(tensor_parallel_size=2, zero_stage=1), "muon"),
}


@pytest.fixture(scope="module")
def measured(tokens) -> dict[str, list]:
    """Every case measured, one launch per world size, each case with a fresh Trainer: the bytes a case's fit holds are
    counted from the live tensors before it (what earlier fits left alive is counted in both and cancels)."""
    out = {}
    for devices in (2, 4):
        calls = {name: (measure, (tokens, devices, precision, kw, optimizer), {})
                 for name, (d, precision, kw, optimizer) in CASES.items() if d == devices}
        results = run_distributed(in_turn, devices, calls, timeout=600)
        out.update({name: [r[name] for r in results] for name in calls})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_model_states_match_measured_bytes(measured, name):
    devices, precision, kw, optimizer = CASES[name]
    tp, pp = kw.get("tensor_parallel_size", 1), kw.get("pipeline_parallel_size", 1)
    dp = devices // (tp * pp)
    for measured_bytes, local, pp_rank in measured[name]:
        held = rank_parameter_split(MODEL, tp, pp, pp_rank=pp_rank)
        params = rank_parameters(MODEL, tp, pp, pp_rank=pp_rank)
        if local is not None:
            assert local == params  # the planner counts exactly what the rank holds
        predicted = sum(rank_model_state_bytes(held, kw.get("zero_stage", 0), dp, 1, precision, pp > 1,
                                               optimizer=optimizer).values())
        assert abs(measured_bytes - predicted) / predicted < 0.05, (measured_bytes, predicted)
