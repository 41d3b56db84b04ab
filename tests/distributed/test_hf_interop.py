"""Hugging Face Llama interop, offline: a tiny LlamaForCausalLM built here (random weights, nothing downloaded)
goes through import -> 0 training steps on a parallel layout -> export, and transformers' own forward agrees."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402
from helpers import datamodule  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.checkpoint.hf import from_hf_config, load_hf, load_into  # noqa: E402
from lightning_mgpu.cli.export import main as export_main  # noqa: E402
from lightning_mgpu.models import Llama  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402


def tiny_hf(directory, tied: bool):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_imported_weights_give_transformers_logits(tmp_path, tied):
    reference = tiny_hf(tmp_path / "hf", tied)
    config, state = load_hf(tmp_path / "hf")
    assert (config.n_heads, config.n_kv_heads, config.tie_embeddings, config.rope_theta) == (4, 2, tied, 500000.0)
    ours = Llama(config)
    load_into(ours, state)
    torch.testing.assert_close(ours(TOKENS), hf_logits(reference, TOKENS), atol=1e-5, rtol=0)


def _round_trip(rank, hf_dir, ckpt_dir, devices, strategy_kwargs):
    config = from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MGPUStrategy(**{"save_consolidated_weights": True, **strategy_kwargs}))
    trainer.fit(LLMModule(config, init_from=f"hf:{hf_dir}"), datamodule(_token_file(hf_dir)))
    trainer.save_checkpoint(str(ckpt_dir))


def _token_file(directory):
    from helpers import make_token_file

    return make_token_file(directory, n_tokens=5000)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, sequence_parallel=True),
                                    dict(pipeline_parallel_size=2, zero_stage=1),
                                    dict(tensor_parallel_size=2, zero_stage=1, save_consolidated_weights=False)],
                         ids=["tp2_sp", "pp2_zero1", "tp2_from_universal_checkpoint"])
def test_import_train_zero_steps_export_round_trip(tmp_path, layout):
    reference = tiny_hf(tmp_path / "hf", tied=False)
    run_distributed(_round_trip, 2, tmp_path / "hf", tmp_path / "ckpt", 2, layout)
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "exported"), "--format", "hf"])
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    torch.testing.assert_close(hf_logits(exported, TOKENS), hf_logits(reference, TOKENS), atol=1e-5, rtol=0)


def test_mismatched_shapes_are_named(tmp_path):
    tiny_hf(tmp_path / "hf", tied=False)
    _, state = load_hf(tmp_path / "hf")
    other = Llama(from_hf_config({**json.loads((tmp_path / "hf" / "config.json").read_text()),
                                  "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"layers.0.feed_forward.w1.weight: checkpoint \(64, 32\) vs model \(96, 32\)"):
        load_into(other, state)
