"""What a transformers directory's model forbids of a valid layout, refused before launch by ``mgpu-train``'s checks
(``config_problems``) as the strategy refuses it at set-up: gpt-oss's attention sinks under context parallelism, and a
load-balancing loss formed otherwise than transformers' MoE families form it under pipeline stages; and a pipeline
rank without routed experts under expert parallelism (DeepSeek V3's dense first layer), accepted (it trains beside an
expert placeholder). Each directory
holds its config.json alone (the model is built on the meta device); the expected texts are the keys a user sets."""

import json

import pytest
import transformers
from cli_helpers import composed

from lightning_mgpu.cli.spec import config_problems

SHAPE = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64)


def directory(tmp_path, config) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return str(tmp_path)


def problems(path: str, *layout: str) -> list[str]:
    return config_problems(composed("model=hf", f"model.path={path}", "data.seq_len=16", "data.global_batch_size=8",
                                    "data.micro_batch_size=1", *layout), launching=False)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    """Two layers, the first dense: at pp2 the first pipeline rank would hold no experts."""
    config = transformers.DeepseekV3Config(
        **SHAPE, num_hidden_layers=2, intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    return directory(tmp_path_factory.mktemp("deepseek"), config)


def test_a_pipeline_rank_without_experts_is_accepted_before_launch(deepseek):
    """Pipeline rank 0 would hold the dense layer alone: the strategy gives it an expert placeholder."""
    assert problems(deepseek, "trainer.devices=4", "parallel.pipeline_parallel_size=2",
                    "parallel.expert_parallel_size=2", "parallel.zero_stage=1") == []
    assert problems(deepseek, "trainer.devices=4", "parallel.pipeline_parallel_size=2", "parallel.zero_stage=1") == []


def test_attention_sinks_under_context_parallelism_are_refused_before_launch(tmp_path):
    config = transformers.GptOssConfig(**SHAPE, num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=None,
                                       layer_types=["full_attention", "full_attention"])
    path = directory(tmp_path / "gpt_oss", config)
    found = problems(path, "trainer.devices=2", "parallel.context_parallel_size=2")
    assert any(line.startswith("parallel.context_parallel_size=2 cannot split GptOssForCausalLM's attention, which "
                               "adds learned sink logits") for line in found), found


def test_a_load_balancing_loss_formed_otherwise_is_refused_before_launch_naming_the_directory(tmp_path):
    config = transformers.JetMoeConfig(vocab_size=256, tie_word_embeddings=False, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
                                       kv_channels=8, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, output_router_logits=True)
    path = directory(tmp_path / "jetmoe", config)
    found = problems(path, "trainer.devices=2", "parallel.pipeline_parallel_size=2")
    assert any(line.startswith(f"{path}/config.json: output_router_logits=True with JetMoeForCausalLM") for line in found), found
