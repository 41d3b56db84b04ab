"""Which parameters Muon steps (optim=muon): the blocks' weight matrices and expert stacks; embeddings, norms, the
output head and routers stay on AdamW. Expected names are written out by hand for each model."""

import pytest
import torch
from helpers import TINY
from hf_helpers import tiny_model
from moe_helpers import TINY_MOE

from lightning_mgpu import LLMModule
from lightning_mgpu.optim import MuonWithAdamW
from lightning_mgpu.optim.choice import build_optimizer


def split(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[set, set]:
    names = {id(p): n for n, p in module.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
    rest = {names[id(p)] for g in optimizer.param_groups if not g.get("muon") for p in g["params"]}
    return muon, rest


def test_llm_module_puts_block_matrices_on_muon():
    module = LLMModule(TINY, optimizer="muon")
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, MuonWithAdamW)
    muon, rest = split(module.model, optimizer)
    assert muon == {f"layers.{i}.{m}.weight" for i in range(2) for m in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert rest == {"tok_embeddings.weight", "output.weight", "norm.weight",
                    *(f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attention", "ffn"))}


def test_experts_on_muon_router_on_adamw():
    module = LLMModule(TINY_MOE, optimizer="muon")
    module.configure_model()
    muon, rest = split(module.model, module.configure_optimizers()["optimizer"])
    assert {n for n in muon if ".experts." in n} == {f"layers.{i}.feed_forward.experts.{w}" for i in range(2)
                                                    for w in ("w1", "w2", "w3")}
    assert {n for n in rest if "router" in n} == {f"layers.{i}.feed_forward.router.gate.weight" for i in range(2)}
    assert not {n for n in muon if "router" in n}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_hugging_face_model_as_it_is(family):
    model = tiny_model(family)
    optimizer = build_optimizer(model.named_parameters(), lambda p: p.shape, "muon", 1e-3, 0.1, (0.9, 0.95), 1e-8)
    muon, rest = split(model, optimizer)
    attention = {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qkvo"}
    assert attention <= muon and not {n for n in muon if "embed" in n or "lm_head" in n or "norm" in n}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= rest
    if family == "qwen3_moe":  # the router is the MoE block's "gate"; the experts are Muon's
        assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= rest
        assert any(".mlp.experts." in n for n in muon)
    else:
        assert {f"model.layers.{i}.mlp.{m}_proj.weight" for i in range(2) for m in ("gate", "up", "down")} <= muon


def test_tensor_parallel_ranks_split_the_orthogonalisation_by_cost():
    """Worked by hand: costs min^2 max = 50.3M, 16.8M, 16.8M, 4.2M; the costliest to rank 0, then each to the least
    loaded rank (rank 1 stays below 50.3M with all three others)."""
    from lightning_mgpu.optim.muon import owners

    shapes = [torch.Size(s) for s in [(768, 256), (256, 256), (256, 256), (128, 256)]]
    assert owners(shapes, 2) == [0, 1, 1, 1]
    assert owners(shapes, 4) == [0, 1, 2, 3]


def test_a_bound_torch_muon_keeps_its_hooks_and_schedulers_quiet():
    """The replaced step runs through torch's step wrapper: step hooks fire, and the LR scheduler neither warns that
    the step was overridden nor that it ran first. A subclass with a step of its own is refused."""
    import warnings

    from lightning_mgpu.optim.muon import bind_whole_matrices

    model = torch.nn.Linear(4, 6, bias=False)
    optimizer = torch.optim.Muon(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    calls = []
    optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *a: calls.append("post"))
    bind_whole_matrices(optimizer, lambda tensor: None)
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        schedule.step()
    assert calls == ["pre", "post"] and not seen, [str(w.message) for w in seen]
    assert not torch.equal(model.weight, before)

    class OwnStep(torch.optim.Muon):
        def step(self, closure=None):
            return super().step(closure)

    with pytest.raises(ValueError, match="OwnStep overrides torch.optim.Muon.step"):
        bind_whole_matrices(OwnStep(model.parameters()), lambda tensor: None)


def test_an_unknown_optimizer_name_is_refused_and_numbered_blocks_of_any_name_are_muons():
    with pytest.raises(ValueError, match="optimizer='Muon' is unknown; choose adamw or muon"):
        build_optimizer([], lambda p: p.shape, "Muon", 1e-3, 0.1, (0.9, 0.95), 1e-8)
    from lightning_mgpu.optim.choice import muon_steps

    matrix = torch.Size([8, 8])
    assert muon_steps("transformer.h.3.attn.c_attn.weight", matrix)  # GPT-2's blocks
    assert muon_steps("0.layers.1.attention.wq.weight", matrix)  # a pipeline stage's block
    assert not muon_steps("0.tok_embeddings.weight", matrix)  # the stage index is no block
    assert not muon_steps("transformer.wte.weight", matrix) and not muon_steps("lm_head.weight", matrix)
    assert not muon_steps("model.layers.0.mlp.gate.weight", matrix)  # a router
