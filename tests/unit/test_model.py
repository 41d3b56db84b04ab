"""The reference Llama: shapes, attention variants, checkpointing; and that it imports nothing distributed."""

import ast
from pathlib import Path

import pytest
import torch

import lightning_mgpu.models.llama as llama_file
from lightning_mgpu.models import LLAMA_SHAPES, Llama, LlamaConfig
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks


@pytest.mark.parametrize("name, billions", [("llama3_1b", 1.24), ("llama3_8b", 8.03), ("llama3_70b", 70.55),
                                            ("llama3_405b", 405.85)])
def test_named_shapes_have_published_sizes(name, billions):
    assert LLAMA_SHAPES[name].num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_parameter_count_formula_matches_module():
    for cfg in (LlamaConfig(), LlamaConfig(tie_embeddings=True), LlamaConfig(head_dim=32, qk_norm=True)):
        assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.num_parameters()


def test_head_dim_is_derived_unless_given_and_qk_norm_adds_only_its_norms():
    """``head_dim=0`` reads as ``dim // n_heads`` and is derived again by ``replace``; a given one stays (Qwen3's heads
    are wider than ``dim / n_heads``). The default model keeps its parameter names; ``qk_norm`` adds two per layer."""
    from dataclasses import replace

    default, qwen = LlamaConfig(), LlamaConfig(head_dim=32, qk_norm=True)
    assert (default.head_dim, replace(default, dim=128).head_dim, default.to_dict()["head_dim"]) == (16, 32, 0)
    assert (qwen.head_dim, replace(qwen, dim=128).head_dim, LlamaConfig(**qwen.to_dict())) == (32, 32, qwen)
    plain, normed = ({n: p.shape for n, p in Llama(c).named_parameters()} for c in (default, qwen))
    assert not any("q_norm" in n or "k_norm" in n for n in plain)
    assert {n for n in normed if n not in plain} == {f"layers.{i}.attention.{k}_norm.weight" for i in range(4)
                                                    for k in "qk"}
    assert normed["layers.0.attention.wq.weight"] == (4 * 32, 64)
    assert normed["layers.0.attention.q_norm.weight"] == (32,)
    assert Llama(qwen).rope_cos.shape == (qwen.max_seq_len, 16)  # rotary tables of the head width
    assert Llama(qwen)(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)


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


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_same_gradients(mode):
    torch.manual_seed(0)
    plain = Llama(LlamaConfig())
    ckpt = Llama(LlamaConfig(activation_checkpointing=mode))
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt.layers, mode) == len(ckpt.layers)
    x = torch.randint(0, 256, (2, 16))
    losses = [m(x).square().mean() for m in (plain, ckpt)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-6
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


@pytest.mark.parametrize("mode, forwards", [("none", 1), ("selective", 2), ("full", 2)])
def test_checkpointed_blocks_run_their_forward_again_in_backward_whole_model_and_stage(mode, forwards):
    """Parity cannot tell whether recomputation ran (it gives the same numbers): count the block's forward calls in
    one forward + backward, through ``LLMModule`` (which applies the config's mode itself outside MGPUStrategy) and
    through a pipeline stage of checkpointed blocks (``parallelize`` applies it after the split; the distributed
    selective test checks it did)."""
    from lightning_mgpu import LLMModule
    from lightning_mgpu.models.llama_plan import llama_stages

    cfg = LlamaConfig(n_layers=2, activation_checkpointing=mode)
    x = torch.randint(0, 256, (2, 16))
    for run in ("module", "stage"):
        lightning_module = LLMModule(cfg)
        lightning_module.configure_model()
        model = lightning_module.model.train()
        calls = []
        model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
        module = model if run == "module" else llama_stages(model, [0], 1)[0]
        module(x).square().mean().backward()
        assert len(calls) == forwards, (run, mode, len(calls))
    assert getattr(model.layers[1], "activation_checkpointing", None) == (None if mode == "none" else mode)


def test_selective_checkpointing_keeps_only_projection_outputs_and_runs_no_projection_again():
    """Bytes a forward leaves allocated for backward (torch's profiler, CPU allocator events) and FLOPs of forward +
    backward (torch's FLOP counter, which on CPU counts the projections' matmuls but not the attention kernel):
    selective keeps exactly each block's input and the outputs of its seven projections, and runs no projection
    again (attention is recomputed); full keeps the inputs alone and runs every projection again."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_mgpu.models.llama import run_layers

    cfg = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=64, max_seq_len=256)
    b, s = 4, 128
    def measure(mode: str) -> tuple[int, int]:
        model = Llama(LlamaConfig(**cfg, activation_checkpointing=mode), init_seed=3).train()
        checkpoint_blocks(model.layers, mode)
        x = model.tok_embeddings(torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(1))).detach()
        gc.collect()  # earlier tests' garbage, freed by a collection inside the forward, would count against it
        gc.disable()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with record_function("forward"):  # nothing else is freed inside it: the bytes it leaves are kept
                    out = run_layers(model.layers, x, model.rope_cos, model.rope_sin)
        finally:
            gc.enable()
        kept = next(e for e in prof.events() if e.name == "forward").cpu_memory_usage - out.nbytes
        del out
        with FlopCounterMode(display=False) as counter:
            run_layers(model.layers, x, model.rope_cos, model.rope_sin).sum().backward()
        return kept, counter.get_total_flops()

    kept, flops = {}, {}
    for mode in ("none", "selective", "full"):
        kept[mode], flops[mode] = measure(mode)
    head_dim = cfg["dim"] // cfg["n_heads"]
    projections = cfg["dim"] + 2 * cfg["n_kv_heads"] * head_dim + cfg["dim"] + 2 * cfg["ffn_hidden"] + cfg["dim"]
    block_inputs = (cfg["n_layers"] - 1) * cfg["dim"]  # the first block's input existed before the forward
    expected = b * s * (cfg["n_layers"] * projections + block_inputs) * 4  # fp32
    assert kept["full"] < kept["selective"] < kept["none"]
    assert abs(kept["selective"] - expected) <= 0.01 * expected, (kept, expected)
    assert flops["selective"] == flops["none"] < flops["full"]


def test_bad_config_lists_every_problem():
    with pytest.raises(ValueError) as err:
        LlamaConfig(dim=30, n_heads=4, n_kv_heads=3, activation_checkpointing="some")
    msg = str(err.value)
    assert "dim=30" in msg and "n_kv_heads=3" in msg and "activation_checkpointing='some'" in msg


def test_unknown_model_name():
    with pytest.raises(ValueError, match="model 'llama9' is unknown; choose one of tiny, llama3_1b"):
        LlamaConfig.from_name("llama9")


@pytest.mark.parametrize("path", [Path(llama_file.__file__).with_name(name)
                                  for name in ("llama.py", "llama_config.py", "moe.py")])
def test_model_file_imports_nothing_distributed(path):
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    allowed = {"lightning_mgpu.problems", "lightning_mgpu.models.moe", "lightning_mgpu.models.llama_config"}
    assert not [n for n in names if n not in allowed and ("distributed" in n or "deepspeed" in n or "lightning" in n)]
