"""Hugging Face Mixtral and Qwen3-MoE interop, offline: a tiny model of each built here with transformers (random
weights, norms included, nothing downloaded) is imported, exported through ``mgpu-export`` bit for bit, and starts
from transformers' own loss and gradient norm; a rank reading a slice of the experts reads only those experts' tensors
and only their part; what either family or our layout cannot do is refused with its key, value and fix."""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file
from test_hf_interop import index_shards, recorded_reads

from lightning_mgpu import LLMModule
from lightning_mgpu.checkpoint.files import write_consolidated
from lightning_mgpu.checkpoint.formats import TRAINER_STATE
from lightning_mgpu.hf.export import hf_sources
from lightning_mgpu.hf.names import from_hf_config, to_hf_config
from lightning_mgpu.hf.weights import HFWeights, load_hf, load_into
from lightning_mgpu.checkpoint.integrity import record_checksums
from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.export import export
from lightning_mgpu.layout import ModelShape, ParallelLayout
from lightning_mgpu.models import Llama

SHAPE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             num_experts_per_tok=2, rms_norm_eps=1e-6)
#: Mixtral: every layer routed, top-2 renormalised. Qwen3-MoE: an explicit head_dim (4 x 16 != 32), q/k norms, a
#: dense first layer (mlp_only_layers=[0]), experts narrower than the dense MLP, top-2 not renormalised.
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_hidden_layers=2, intermediate_size=24, num_local_experts=4)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, num_experts=4, head_dim=16,
                       mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=False)),
}
BATCH = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))


def tiny_hf(directory, family):
    """A random model of ``family`` saved by transformers; every tensor random (norms 1 +- 0.2), so that a norm read
    into the wrong place or an expert transposed wrongly changes the logits."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(3)
    model = model_cls(config_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return {"name": request.param, "hf": tiny_hf(root / "hf", request.param), "dir": root / "hf", "root": root}


def test_the_config_maps_onto_ours(family):
    config = from_hf_config(json.loads((family["dir"] / "config.json").read_text()))
    assert (config.num_experts, config.experts_per_token, config.shared_experts) == (4, 2, 0)
    if family["name"] == "qwen3_moe":
        assert (config.head_dim, config.qk_norm, config.dense_layers, config.expert_ffn_hidden, config.ffn_hidden,
                config.router_renormalize) == (16, True, 1, 16, 48, False)
    else:
        assert (config.head_dim, config.qk_norm, config.dense_layers, config.expert_ffn_hidden,
                config.router_renormalize) == (8, False, 0, 24, True)


def test_import_then_mgpu_export_is_bit_exact(family, tmp_path):
    """Every tensor transformers wrote comes back under its name with the same bits, and transformers loads the
    export with nothing missing or left over (so it wrote the per-expert layout transformers reads), here from
    several shards and their index."""
    config, state = load_hf(family["dir"])
    model = Llama(config)
    load_into(model, state)
    write_consolidated(tmp_path / "ckpt", model.state_dict(), config.to_dict())
    record_checksums(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", max_shard_size="50KB")
    original = load_file(str(family["dir"] / "model.safetensors"))
    shards = index_shards(tmp_path / "out")  # 116352 bytes of Mixtral, 160000 of Qwen3-MoE, under 50000 a file
    assert len(shards) == (3 if family["name"] == "mixtral" else 4)
    exported = {k: v for f in (tmp_path / "out").glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(exported) == sorted(original)
    assert [k for k in original if not torch.equal(exported[k], original[k])] == []
    assert from_hf_config(json.loads((tmp_path / "out" / "config.json").read_text())) == config
    _, model_cls, _ = FAMILIES[family["name"]]
    back, info = model_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    with torch.no_grad():
        assert torch.equal(back.eval()(BATCH).logits, family["hf"](BATCH).logits)


def write_universal(directory, config, state):
    """A universal checkpoint of a whole model written in this process, as ``LLMModule`` checkpoints hold its weights
    (DCP's ``param/model.NAME``) and its config (the trainer state's ``hyper_parameters``); without the Adam
    moments, which an export never reads."""
    dcp.save({f"param/model.{name}": value for name, value in state.items()}, checkpoint_id=str(directory),
             no_dist=True)
    torch.save({"hyper_parameters": {"model": config.to_dict()}}, directory / TRAINER_STATE)
    record_checksums(directory)


#: Mixtral in fp32 under ``--max-shard-size 20KB`` (20000 bytes), worked by hand: each expert's tensor is 32 x 24 x 4 =
#: 3072 bytes (a stacked weight 12288), the embedding and head 8192, wq and wo 4096, wk and wv 2048, a router 512, a
#: norm 128. Shards: 8192+128+4096+2048+2048 = 16512 | wo, norm, router, w1 = 17024 | w3, w2 experts 0-1 = 18432 |
#: w2 experts 2-3, layer 1's attention, norm and router = 19200 | w1, w3 experts 0-1 = 18432 | w3 experts 2-3, w2,
#: norm = 18560 | head 8192. A stacked weight split over two shards is read for each of them.
MIXTRAL_READS_20KB = [
    ["tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.0.attention.wq.weight",
     "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"],
    ["layers.0.attention.wo.weight", "layers.0.ffn_norm.weight", "layers.0.feed_forward.router.gate.weight",
     "layers.0.feed_forward.experts.w1"],
    ["layers.0.feed_forward.experts.w3", "layers.0.feed_forward.experts.w2"],
    ["layers.0.feed_forward.experts.w2", "layers.1.attention_norm.weight", "layers.1.attention.wq.weight",
     "layers.1.attention.wk.weight", "layers.1.attention.wv.weight", "layers.1.attention.wo.weight",
     "layers.1.ffn_norm.weight", "layers.1.feed_forward.router.gate.weight"],
    ["layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w3"],
    ["layers.1.feed_forward.experts.w3", "layers.1.feed_forward.experts.w2", "norm.weight"],
    ["output.weight"],
]


def test_a_universal_checkpoint_is_exported_one_shard_at_a_time(family, tmp_path, monkeypatch):
    """Each read of the checkpoint asks for the parameters of one shard's tensors and nothing else, shard by shard
    (a stacked weight whole, once for each shard holding some of its experts); transformers loads the shards and
    gives the model's own logits."""
    config, state = load_hf(family["dir"])
    write_universal(tmp_path / "ckpt", config, state)
    reads = recorded_reads(monkeypatch)
    export(tmp_path / "ckpt", tmp_path / "out", max_shard_size="20KB")
    shards = index_shards(tmp_path / "out")
    sources = hf_sources({name: value.shape for name, value in state.items()}, config)
    assert [sorted(names) for names in reads] == [sorted({sources[key][0] for key in shard}) for shard in shards]
    if family["name"] == "mixtral":
        assert reads == MIXTRAL_READS_20KB
        assert [len(shard) for shard in shards] == [5, 7, 6, 9, 6, 7, 1]
        assert [key.split(".experts.")[1] for key in shards[2] if ".w2." in key] == ["0.w2.weight", "1.w2.weight"]
    _, model_cls, _ = FAMILIES[family["name"]]
    exported = model_cls.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(BATCH).logits, family["hf"](BATCH).logits, atol=1e-5, rtol=0)


def test_first_loss_and_gradient_norm_are_transformers(family):
    """fp32, one batch: our loss is transformers' (its router logits are not asked for, so neither adds a balancing
    loss: ours is switched off for the gradient norm, which it would otherwise change)."""
    config = replace(from_hf_config(json.loads((family["dir"] / "config.json").read_text())), aux_loss="none")
    module = LLMModule(config, init_from=f"hf:{family['dir']}")
    module.configure_model()
    loss = module.loss(BATCH)
    loss.backward()
    reference = family["hf"]
    reference.zero_grad()
    expected = reference(BATCH, labels=BATCH).loss
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-5, (loss.item(), expected.item())
    norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    assert abs(norm.item() - expected_norm.item()) < 1e-5, (norm.item(), expected_norm.item())


class _Recording:
    """A safetensors file handle that notes every tensor a slice is taken of."""

    def __init__(self, handle, read: list) -> None:
        self.handle, self.read = handle, read

    def get_slice(self, key):
        self.read.append(key)
        return self.handle.get_slice(key)


@pytest.mark.parametrize("weight, index", [("w1", (slice(2, 4), slice(None), slice(8, 16))),
                                           ("w2", (slice(2, 4), slice(0, 8), slice(None)))], ids=["w1", "w2"])
def test_a_slice_of_experts_reads_only_those_experts(family, weight, index):
    """Experts 2 and 3 of 4, and half of each expert's hidden width (a tensor-parallel rank's share), through the
    module's ``initial_value`` as ``MGPUStrategy`` asks it: exactly those values, from those experts' tensors only."""
    layer = family["hf"].config.num_hidden_layers - 1
    name = f"layers.{layer}.feed_forward.experts.{weight}"
    _, whole = load_hf(family["dir"])
    module = LLMModule(from_hf_config(json.loads((family["dir"] / "config.json").read_text())),
                       init_from=f"hf:{family['dir']}")
    weights = module._hf_weights = HFWeights(family["dir"])
    read: list = []
    weights._files = {key: _Recording(handle, read) for key, handle in weights._files.items()}
    got = module.initial_value(f"model.{name}", whole[name].shape, index)
    assert got.shape == whole[name][index].shape and got.shape[0] == 2
    assert torch.equal(got, whole[name][index])
    block = "block_sparse_moe" if family["name"] == "mixtral" else "mlp"
    assert sorted({key.split(f"{block}.experts.")[1].split(".")[0] for key in read}) == ["2", "3"], read
    assert len(read) == 2


def test_qk_norm_with_tensor_parallelism_is_refused_with_its_fix(family):
    config = from_hf_config(json.loads((family["dir"] / "config.json").read_text()))
    shape = ModelShape.of(config)
    assert shape.qk_norm is config.qk_norm
    ParallelLayout(world_size=2, pipeline_parallel_size=2, model=shape)  # the other axes still split it
    if not config.qk_norm:
        assert ParallelLayout(world_size=2, tensor_parallel_size=2, model=shape).tensor_parallel_size == 2
        return
    with pytest.raises(ValueError) as refused:
        ParallelLayout(world_size=2, tensor_parallel_size=2, model=shape)
    message = str(refused.value)
    assert "tensor_parallel_size=2 cannot split a model with qk_norm=True" in message
    assert "set tensor_parallel_size=1" in message


def test_what_a_family_cannot_say_is_refused_every_key_at_once(family):
    hf = json.loads((family["dir"] / "config.json").read_text())
    if family["name"] == "qwen3_moe":
        bad = {**hf, "mlp_only_layers": [1], "use_sliding_window": True, "rope_parameters": {"rope_type": "yarn"}}
        named = ["mlp_only_layers=[1] with decoder_sparse_step=1 makes layers [1] dense",
                 "give decoder_sparse_step=1 and mlp_only_layers=[0, ..., N-1]", "use_sliding_window=True",
                 "rope_type='yarn'"]
    else:
        bad = {**hf, "router_jitter_noise": 0.1, "sliding_window": 16, "num_experts_per_tok": None}
        named = ["router_jitter_noise=0.1", "set it to 0.0", "sliding_window=16 is shorter than "
                 "max_position_embeddings=64", "num_experts_per_tok is missing"]
    with pytest.raises(ValueError) as refused:
        from_hf_config(bad)
    assert all(part in str(refused.value) for part in named), str(refused.value)


def test_a_model_the_family_cannot_hold_is_refused_before_writing(family, tmp_path):
    config = from_hf_config(json.loads((family["dir"] / "config.json").read_text()))
    odd = replace(config, shared_experts=1, router_score="sigmoid", router_bias_rate=0.001)
    with pytest.raises(ValueError) as refused:
        to_hf_config(odd)
    for key in ("shared_experts=1", "router_score='sigmoid'", "router_bias_rate=0.001"):
        assert key in str(refused.value)
    model = Llama(odd)
    write_consolidated(tmp_path / "ckpt", model.state_dict(), odd.to_dict())
    record_checksums(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="shared_experts=1: .* has no such option"):
        export(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
