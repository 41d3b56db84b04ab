"""The planner's model-state bytes of a LoRA run (the base frozen: its storage only; the adapters: gradients, fp32
master, Adam moments) against what each rank of the engine really holds, to 5%, at tp2 x dp2 ZeRO-1 (bf16-mixed) and
tp2 x dp2 ZeRO-3 (fp32), both in one launch of 4 ranks."""

from typing import Any

import lightning as L
import pytest
import torch
from helpers import MeasureBeforeSecondStep
from hf_helpers import token_ids
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.planner.adapters import LoraShape
from lightning_mgpu.planner.memory import rank_model_state_bytes
from lightning_mgpu.planner.model_stats import rank_parameter_split
from lightning_mgpu.testing import live_tensor_bytes, run_distributed

#: Large enough that the frozen base outweighs DeepSpeed's smallest bucket (2**17 elements); rank 8 adapters on every
#: decoder linear: about 3% of the parameters.
SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=False)
RANK = 8

#: name -> (precision, strategy arguments)
CASES = {
    "tp2dp2-z1-bf16": ("bf16-mixed", dict(tensor_parallel_size=2, zero_stage=1)),
    "tp2dp2-z3": ("32-true", dict(tensor_parallel_size=2, zero_stage=3)),
}


def hf_config() -> Any:
    import transformers

    return transformers.LlamaConfig(**SIZES, attn_implementation="sdpa")


class LoraLM(L.LightningModule):
    """PEFT's LoRA over a transformers Llama, AdamW over what trains: as a user writes it."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(3)
        base = transformers.AutoModelForCausalLM.from_config(hf_config())
        self.llm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear"))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.llm(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_ids(), batch_size=2)


def measure(rank: int, precision: str, kw: dict) -> tuple[int, int, int]:
    """(bytes the fit holds at the peak, parameters of the rank's shard or -1 under ZeRO-3, trainable of them)."""
    before = live_tensor_bytes()
    callback = MeasureBeforeSecondStep()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=MGPUStrategy(**kw), precision=precision, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[callback])
    trainer.fit(LoraLM())
    params = list(trainer.strategy.model.module.parameters())
    local = -1 if kw["zero_stage"] == 3 else sum(p.numel() for p in params)
    trainable = -1 if kw["zero_stage"] == 3 else sum(p.numel() for p in params if p.requires_grad)
    return callback.bytes - before, local, trainable


@pytest.fixture(scope="module")
def measured() -> dict[str, list]:
    from helpers import in_turn

    calls = {name: (measure, (precision, kw), {}) for name, (precision, kw) in CASES.items()}
    results = run_distributed(in_turn, 4, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_model_states_match_measured_bytes(measured, name):
    from lightning_mgpu.hf.names import planning_shape

    precision, kw = CASES[name]
    shape = planning_shape(hf_config().to_dict())
    import dataclasses

    held = rank_parameter_split(dataclasses.replace(shape, adapters=LoraShape(RANK)), tp=2)
    predicted = sum(rank_model_state_bytes(held, kw["zero_stage"], 2, 1, precision).values())
    for measured_bytes, local, trainable in measured[name]:
        if local >= 0:
            assert (local, trainable) == (held.total, held.total - held.frozen)  # the planner counts what the rank holds
        assert abs(measured_bytes - predicted) / predicted < 0.05, (measured_bytes, predicted)
