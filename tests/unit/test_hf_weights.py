"""Each rank's slices of a ``from_pretrained`` directory, read into a model built on the meta device
(``lightning_mgpu.hf.weights``): compared with what ``transformers``' own loader builds from the same directory."""

import pytest
import torch
import transformers
from hf_helpers import tiny_config
from safetensors.torch import load_file, save_file

from lightning_mgpu.hf.module import load_causal_lm
from lightning_mgpu.hf.weights import PretrainedSlices


def mixtral_config():
    return transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64)


class Reads:
    """A safetensors file handle that records the tensors read whole (``get_tensor``) rather than by slice."""

    def __init__(self, handle) -> None:
        self.handle, self.whole = handle, set()

    def get_slice(self, key):
        return self.handle.get_slice(key)

    def get_tensor(self, key):
        self.whole.add(key)
        return self.handle.get_tensor(key)


def saved(tmp_path, config):
    torch.manual_seed(2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", ["llama_tied", "qwen3_moe", "mixtral"])
def test_slices_equal_what_from_pretrained_loads(tmp_path, family):
    """Dense and tied tensors by their own names; packed experts assembled from one tensor per expert (Qwen-MoE's
    gate/up/down, Mixtral's block_sparse_moe w1/w3/w2)."""
    config = {"llama_tied": lambda: tiny_config("llama", tied=True), "qwen3_moe": lambda: tiny_config("qwen3_moe"),
              "mixtral": mixtral_config}[family]()
    directory = saved(tmp_path, config)
    theirs = dict(transformers.AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    skeleton = load_causal_lm(str(directory), on_meta=True)
    slices = PretrainedSlices(directory, skeleton, prefix="llm.")
    assert slices.problems == []
    slices._files = {key: Reads(handle) for key, handle in slices._files.items()}  # what is read, and how
    for name, param in skeleton.named_parameters():
        whole = slices(f"llm.{name}", param.shape, tuple(slice(None) for _ in param.shape))
        assert torch.equal(whole, theirs[name]), name
        index = (slice(1, 3),) + tuple(slice(0, n // 2) for n in param.shape[1:])  # experts 1-2, or rows 1-2
        assert torch.equal(slices(f"llm.{name}", param.shape, index), theirs[name][index]), name
    assert slices.read == 2 * slices.total - sum(  # every whole tensor once, then the slices
        p.numel() - p[(slice(1, 3),) + tuple(slice(0, n // 2) for n in p.shape[1:])].numel()
        for p in skeleton.parameters())
    whole = {key for handle in slices._files.values() for key in handle.whole}
    assert all(".experts." in key for key in whole), whole  # only an expert's tensors are read whole: a slice else
    buffers = dict(transformers.AutoModelForCausalLM.from_pretrained(directory).named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in skeleton.named_buffers())


def test_a_directory_missing_tensors_is_refused_naming_each_at_the_first_read(tmp_path):
    directory = saved(tmp_path, tiny_config("qwen3_moe"))
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"], tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    slices = PretrainedSlices(directory, load_causal_lm(str(directory), on_meta=True), prefix="llm.")
    assert [p.split(" ")[1] for p in slices.problems] == ["model.layers.0.mlp.experts.3.up_proj.weight",
                                                        "model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match="experts.3.up_proj"):
        slices("llm.model.norm.weight", torch.Size([32]), (slice(None),))


def test_a_directory_without_safetensors_builds_for_a_dry_run_and_refuses_a_read(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    slices = PretrainedSlices(tmp_path, load_causal_lm(str(tmp_path), on_meta=True), prefix="llm.")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        slices("llm.model.norm.weight", torch.Size([32]), (slice(None),))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "llama_tied", "gpt_oss"])
def test_export_writes_the_tensors_save_pretrained_writes(tmp_path, family):
    """The other way (``mgpu-export`` of a ``model=hf`` run): each written tensor, cut from the model's parameters as
    ``written_tensors`` says, equals what ``save_pretrained`` writes under that name, and no name is missing (gpt-oss's
    files keep its experts packed, which the export reads off the source directory)."""
    from lightning_mgpu.hf.export import packed_on_disk, written_tensors

    gpt_oss = lambda: transformers.GptOssConfig(  # noqa: E731
        num_local_experts=4, num_experts_per_tok=2, vocab_size=64, hidden_size=32, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config = {"llama_tied": lambda: tiny_config("llama", tied=True), "qwen3_moe": lambda: tiny_config("qwen3_moe"),
              "mixtral": mixtral_config, "gpt_oss": gpt_oss}[family]()
    directory = saved(tmp_path, config)
    theirs = load_file(str(directory / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head too: it is not written again
    assert packed_on_disk(directory) == (family == "gpt_oss")
    tensors = written_tensors({n: p.shape for n, p in params.items()}, config.to_dict(), packed_on_disk(directory))
    assert sorted(tensors) == sorted(theirs)
    for key, ((name, expert, rows), shape) in tensors.items():
        value = params[name] if expert is None else params[name][expert]
        value = value if rows is None else value[rows]
        assert tuple(value.shape) == shape and torch.equal(value, theirs[key]), key
