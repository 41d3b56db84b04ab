"""The Hydra configs compose as the Python objects they mirror: every option of every group, every recipe (validated,
and its every rank built on the meta device by a launch's own ``parallelize()``), typos and wrong types refused."""

import json

import pytest
from cli_helpers import composed, group_options, recipe_overrides, resolved
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from lightning_mgpu.cli.build import build_datamodule, build_strategy
from lightning_mgpu.cli.paths import recipes_dir
from lightning_mgpu.cli.spec import run_spec
from lightning_mgpu.models import LlamaConfig


#: A transformers Llama's config.json (a shape only: nothing here reads weights).
HF_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}


@pytest.mark.parametrize("group", ["model", "data", "parallel", "trainer", "optim", "cluster"])
def test_every_group_option_composes(group, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))  # model=hf reads the shape of a directory's config
    for option in group_options(group):
        extra = {("data", "tokens"): ["data.path=/dev/null"], ("model", "hf"): [f"model.path={tmp_path}"]}.get(
            (group, option), [])
        cfg = composed(f"{group}={option}", *extra)
        spec = resolved(cfg)
        if group == "parallel":
            assert build_strategy(spec).layout_request.zero_stage == cfg.parallel.zero_stage


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.yaml")))
def test_every_recipe_composes_and_validates(recipe):
    cfg = composed(*recipe_overrides(recipe))
    if cfg.cluster.launcher == "slurm":  # as inside the submitted job
        cfg = composed(*recipe_overrides(recipe), "cluster=local")
    spec = run_spec(cfg)  # raises with every problem
    build_strategy(spec)
    build_datamodule(spec)


def test_typo_and_wrong_type_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_step"):
        composed("trainer.max_step=3")
    with pytest.raises((ConfigCompositionException, ValidationError), match="zero_stage"):
        composed("parallel.zero_stage=two")
    with pytest.raises(ConfigCompositionException, match="nope"):
        composed("model=nope")


#: family -> a small config.json holding what the family adds to a Llama layer (hidden 256, 4 layers, 8 heads of
#: 32, 4 key/value heads), and those additions worked by hand: (whole vectors, split vectors) a layer
FAMILY_CONFIGS = {
    "qwen2": ({"model_type": "qwen2"}, (0, (8 + 2 * 4) * 32)),  # q/k/v biases, split with their projections
    "gemma2": ({"model_type": "gemma2", "head_dim": 64, "tie_word_embeddings": False}, (2 * 256, 0)),  # 4 norms
    "olmo2": ({"model_type": "olmo2"}, ((8 + 4) * 32, 0)),  # q/k norms over every head
    "phi3": ({"model_type": "phi3"}, (0, 0)),  # fused q/k/v and gate/up: the same sizes
    # mixtures of experts, their expert layers counted as built (experts whole on every tensor-parallel rank)
    "qwen3_moe": ({"model_type": "qwen3_moe", "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64}, None),
    # expert layers 1 and 3 only (decoder_sparse_step=2), then one whose layer 1 is dense (mlp_only_layers)
    "qwen2_moe": ({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "decoder_sparse_step": 2}, None),
    "qwen2_moe_dense_1": ({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 64, "mlp_only_layers": [1]}, None),
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "deepseek_v3": ({"model_type": "deepseek_v3", "num_key_value_heads": 8, "n_routed_experts": 8,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 64,
                     "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32}, None),
}


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_transformers_family_dry_runs_as_planned_and_counts_its_own_parameters(family, tmp_path):
    """The planner counts a family's layer as transformers builds it (``hf.layer_sizes``): every rank's built share on
    the meta device equals the planner's, and the whole count equals the model transformers builds itself."""
    import torch
    import transformers

    config = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": False, "pad_token_id": 0,
              **FAMILY_CONFIGS[family][0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = composed("model=hf", f"model.path={tmp_path}", "trainer=gpu", "trainer.devices=8", "data.seq_len=256",
                   "parallel.tensor_parallel_size=4", "parallel.pipeline_parallel_size=2")
    from lightning_mgpu.cli.dry_run import rank_shares

    spec = run_spec(cfg, launching=False)
    extras, by_hand = spec.model.layer_extras, FAMILY_CONFIGS[family][1]
    assert by_hand is None or (extras.whole_vectors, extras.split_vectors) == by_hand, extras
    layout, shares = rank_shares(spec)
    assert [(s.tp_rank, s.pp_rank) for s in shares if not s.as_planned] == [], [(s.parameters, s.planned)
                                                                                for s in shares]
    with torch.device("meta"):
        whole = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert spec.model.num_parameters() == sum(p.numel() for p in whole.parameters())


def test_named_model_and_overrides_build_the_shape():
    cfg = composed("model=llama3_8b", "model.n_layers=4")
    assert run_spec(cfg).model == LlamaConfig.from_name("llama3_8b", n_layers=4, activation_checkpointing="full")


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.yaml") if "405b" not in p.stem))
def test_dry_run_builds_every_rank_of_every_recipe_on_meta_as_planned(recipe):  # 405B: the CLI test below
    """The recipe's real plan and stage split on the meta device, per pipeline rank: counts equal the planner's."""
    from lightning_mgpu.cli.dry_run import rank_shares

    cfg = composed(*recipe_overrides(recipe), *(["cluster=local"] if composed(f"recipe={recipe}").cluster.launcher
                                                == "slurm" else []))
    layout, shares = rank_shares(run_spec(cfg, launching=False))
    assert sorted({s.pp_rank for s in shares}) == list(range(layout.size("pp")))
    assert all(s.as_planned for s in shares)  # routed experts and the rest alike
    held = sum(s.parameters + (layout.size("ep") - 1) * s.experts for s in shares if s.tp_rank == 0)
    assert held * layout.size("tp") >= resolved(cfg).model.num_parameters()  # the ranks together hold the whole model
    # (plus vocab padding), each expert-parallel rank its share of the experts
