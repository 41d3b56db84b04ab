"""The reference Llama: shapes, attention variants, checkpointing; and that it imports nothing distributed."""

import ast
from pathlib import Path

import pytest
import torch

import lightning_mgpu.models.llama as llama_file
from lightning_mgpu.models import LLAMA_SHAPES, Llama, LlamaConfig


@pytest.mark.parametrize("name, billions", [("llama3_1b", 1.24), ("llama3_8b", 8.03), ("llama3_70b", 70.55),
                                            ("llama3_405b", 405.85)])
def test_named_shapes_have_published_sizes(name, billions):
    assert LLAMA_SHAPES[name].num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_parameter_count_formula_matches_module():
    for cfg in (LlamaConfig(), LlamaConfig(tie_embeddings=True)):
        assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.num_parameters()


def test_forward_shape_gqa_and_tied():
    cfg = LlamaConfig(n_heads=4, n_kv_heads=1, tie_embeddings=True)
    model = Llama(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, cfg.vocab_size, (2, 10)))
    assert logits.shape == (2, 10, cfg.vocab_size)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)


def test_full_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    plain = Llama(LlamaConfig())
    ckpt = Llama(LlamaConfig(activation_checkpointing="full"))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 16))
    for m in (plain, ckpt):
        m(x).square().mean().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_bad_config_lists_every_problem():
    with pytest.raises(ValueError) as err:
        LlamaConfig(dim=30, n_heads=4, n_kv_heads=3, activation_checkpointing="some")
    msg = str(err.value)
    assert "dim=30" in msg and "n_kv_heads=3" in msg and "activation_checkpointing='some'" in msg


def test_unknown_model_name():
    with pytest.raises(ValueError, match="model 'llama9' is unknown; choose one of tiny, llama3_1b"):
        LlamaConfig.from_name("llama9")


def test_model_file_imports_nothing_distributed():
    tree = ast.parse(Path(llama_file.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if "distributed" in n or "deepspeed" in n or "lightning" in n]
