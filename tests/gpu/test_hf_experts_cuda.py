"""A ``transformers`` mixture of experts trained as it is on CUDA through ``mgpu-train model=hf``: in bf16 on one GPU
(every expert on the rank, transformers' grouped experts on CUDA), and split by expert parallelism over two GPUs with
NCCL's all-to-all (skipped on one GPU: NCCL refuses two ranks of one communicator on one device). The CPU suite holds
the parity with one process (``tests/distributed/test_hf_experts.py``); here the run must start, split the experts as
the layout line says, and train to finite losses on the device."""

import math
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from cli_helpers import BIN, read_metric

pytestmark = pytest.mark.gpu

STEPS = 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (8 experts, top 2, vocabulary 64 as the token file's) saved as a user's directory."""
    directory = tmp_path_factory.mktemp("qwen3_moe")
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def train(moe_dir: Path, token_file, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "mgpu-train"), "model=hf", f"model.path={moe_dir}", "trainer=gpu", "data=tokens",
         f"data.path={token_file}", "data.seq_len=16", "data.global_batch_size=8", "data.micro_batch_size=2",
         f"trainer.max_steps={STEPS}", "trainer.enable_progress_bar=false", "sample.max_new_tokens=0",
         f"hydra.run.dir={run_dir}", *args], capture_output=True, text=True, timeout=240)


def test_a_transformers_moe_trains_in_bf16_on_one_gpu(moe_dir, token_file, tmp_path):
    done = train(moe_dir, token_file, tmp_path / "run", "trainer.devices=1", "trainer.precision=bf16-mixed")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    losses = read_metric(tmp_path / "run" / "metrics.csv", "train/loss")
    assert losses and all(math.isfinite(loss) for loss in losses), losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism over NCCL needs 2 GPUs: NCCL refuses "
                    "two ranks of one communicator on one device")
def test_a_transformers_moe_splits_its_experts_over_two_gpus(moe_dir, token_file, tmp_path):
    done = train(moe_dir, token_file, tmp_path / "run", "trainer.devices=2", "parallel.expert_parallel_size=2",
                 "parallel.zero_stage=1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "blocks of 8 experts, 4 on each rank of 2" in out, out[-4000:]
    losses = read_metric(tmp_path / "run" / "metrics.csv", "train/loss")
    assert losses and all(math.isfinite(loss) for loss in losses), losses
