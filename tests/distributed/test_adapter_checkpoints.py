"""An adapter run's checkpoints and exports, as a user meets them: LoRA over a model loaded with ``from_pretrained``
from a directory, trained 2 steps at tp2 with sequence parallelism and saved; resumed on pp2 at ZeRO-1 (another
layout) for 2 more and saved again, with AdamW (its moments travel in the checkpoint). The checkpoints hold what trains (a fraction of a full fine-tune's, same layout);
the 4 steps equal one plain PEFT loop; ``mgpu-export --format peft`` writes what ``PeftModel.from_pretrained`` loads to
the trained model's logits, and ``--merge`` what ``from_pretrained`` loads to PEFT's own merged model's logits."""

from pathlib import Path

import pytest
import torch
from hf_helpers import global_batches, tiny_model, token_ids
from helpers import in_turn, max_abs_diff
from peft_helpers import fit_adapted, single_process_adapted

from lightning_mgpu.cli.export import main as export_main
from lightning_mgpu.testing import run_distributed

peft = pytest.importorskip("peft")

FIRST = dict(tensor_parallel_size=2, sequence_parallel=True)
SECOND = dict(pipeline_parallel_size=2, num_microbatches=2, zero_stage=1)


def size_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_ckpts")
    base = root / "base"
    tiny_model("llama").save_pretrained(base)
    lora = dict(base=str(base), targets=["q_proj", "v_proj"])
    first = run_distributed(in_turn, 2, {
        "lora": (fit_adapted, ("lora", "llama", 2), dict(steps=2, lora=lora, save_to=str(root / "lora2"),
                                                         optimizer="adamw", **FIRST)),
        "full": (fit_adapted, ("full", "llama", 2), dict(steps=2, save_to=str(root / "full2"), **FIRST))})
    both = run_distributed(in_turn, 2, {
        "lora": (fit_adapted, ("lora", "llama", 2), dict(steps=4, lora=lora, ckpt_path=str(root / "lora2"),
                                                         save_to=str(root / "lora4"), optimizer="adamw", **SECOND)),
        # no adapters, embeddings and layer 0 frozen: pipeline rank 0 trains nothing but its placeholder
        "frozen": (fit_adapted, ("frozen", "llama", 2), dict(steps=1, save_to=str(root / "frozen_pp"), **SECOND))})
    second = [r["lora"] for r in both]
    batches = global_batches([r["lora"] for r in first]) + global_batches(second)
    return root, first, second, single_process_adapted("lora", "llama", batches, lora=lora, optimizer="adamw")


def test_an_adapter_checkpoint_holds_what_trains_and_resumes_on_another_layout(runs):
    root, first, second, expected = runs
    for r in second:
        assert max_abs_diff(r["losses"], expected["losses"][2:]) < 1e-5, (r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"][2:]) < 1e-5
    trained = second[0]["weights"]
    for name in expected["trainable"]:
        assert torch.allclose(trained[name], expected["weights"][name], rtol=0, atol=1e-5), name
    # the base is not in it: a full fine-tune's checkpoint of the same model and layout is several times its size
    adapters, full = size_on_disk(root / "lora2"), size_on_disk(root / "full2")
    assert adapters * 2 < full, (adapters, full)


def test_peft_export_loads_in_peft_to_the_trained_logits(runs):
    import transformers

    root, _, _, expected = runs
    export_main([str(root / "lora4"), str(root / "peft"), "--format", "peft"])
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (root / "peft").iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    loaded = peft.PeftModel.from_pretrained(base, root / "peft")
    ids = token_ids(4)
    with torch.no_grad():
        want = expected["model"](input_ids=ids).logits
        assert (loaded(input_ids=ids).logits - want).abs().max() < 1e-5


def test_merged_export_loads_to_peft_merged_logits(runs):
    import transformers

    root, _, _, expected = runs
    export_main([str(root / "lora4"), str(root / "merged"), "--merge"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged")
    reference = expected["model"].merge_and_unload()
    ids = token_ids(4)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-5
        # the adapters changed the base (a merge that wrote the base back would pass the rest only if LoRA did nothing)
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-4


def test_an_export_of_a_run_without_adapters_is_refused(runs, capsys):
    root = runs[0]
    with pytest.raises(SystemExit) as exit_:
        export_main([str(root / "full2"), str(root / "nothing"), "--format", "peft"])
    assert exit_.value.code == 2
    assert "holds no adapters" in capsys.readouterr().err


def saved_keys(path: Path) -> set[str]:
    from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata

    return set(read_dcp_metadata(path).state_dict_metadata)


def test_frozen_weights_are_saved_by_value_unless_adapters_name_their_base(runs):
    """A partly frozen run without adapters saves its frozen weights (value only), never a stage's placeholder; an
    adapter run leaves its base out and records its names; resuming it into a run that trains the base is refused."""
    from lightning_mgpu.checkpoint.universal import read_trainer_state

    root = runs[0]
    frozen = saved_keys(root / "frozen_pp")
    assert "param/llm.model.embed_tokens.weight" in frozen and "exp_avg/llm.model.embed_tokens.weight" not in frozen
    assert not any("placeholder" in key for key in frozen), sorted(frozen)
    adapters = saved_keys(root / "lora4")
    assert not any("base_layer" in key or "embed_tokens" in key for key in adapters), sorted(adapters)[:5]
    assert "llm.base_model.model.model.embed_tokens.weight" in read_trainer_state(root / "lora4")["frozen_parameters"]
    with pytest.raises(Exception, match="holds no value of .* parameter.*that train now"):
        run_distributed(fit_adapted, 2, "lora", "llama", 2, steps=3, ckpt_path=str(root / "lora2"),
                        lora=dict(base=str(root / "base"), targets=["q_proj", "v_proj"],
                                  modules_to_save=["embed_tokens"]), **FIRST)


def test_a_whole_model_export_of_an_adapter_run_is_refused(runs, capsys):
    root = runs[0]
    with pytest.raises(SystemExit) as exit_:
        export_main([str(root / "lora4"), str(root / "whole")])
    assert exit_.value.code == 2
    assert "--format peft" in capsys.readouterr().err
