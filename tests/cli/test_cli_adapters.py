"""``mgpu-train model=hf model.path=DIR adapters=lora ...``: LoRA over a ``transformers`` directory from the command
line, at tp2 x dp2 with sequence parallelism and ZeRO-1, against a plain PEFT loop in one process (the adapters'
initial values written here from their stated rule); its checkpoint exported with ``mgpu-export --format peft``; bad
settings and targets that match nothing refused before launch with the key and the fix."""

import math
import re
import zlib

import pytest
import torch
import transformers
from cli_helpers import BIN, TINY_MODEL, cli_args, composed, read_metric, trained_like_the_cli
from forked_cli import run_cli
from helpers import max_abs_diff

from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata
from lightning_mgpu.cli.spec import config_problems

peft = pytest.importorskip("peft")

STEPS, LR, WARMUP, MIN_LR, DECAY, SEED = 4, 3e-3, 2, 0.1, 0.1, 3
LORA = ["adapters=lora", "adapters.rank=4", "adapters.alpha=8", "adapters.targets=all-linear", f"adapters.seed={SEED}"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def stated_initial_values(model: torch.nn.Module) -> None:
    """The rule the docs state: lora_A uniform in +-1/sqrt(fan_in) from a generator seeded by seed * 1000003 + the
    CRC-32 of its name in the LightningModule; lora_B zero."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                g = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(f"llm.{name}".encode()))
                bound = 1 / math.sqrt(param.shape[1])
                param.copy_(torch.rand(param.shape, generator=g) * 2 * bound - bound)
            elif ".lora_B." in name:
                param.zero_()


def reference(directory, token_file, targets="all-linear") -> dict:
    """The same run as a plain loop (``trained_like_the_cli``) of PEFT's model over the directory's."""
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, use_safetensors=True)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    stated_initial_values(model)
    return trained_like_the_cli(model, token_file, STEPS, LR, WARMUP, MIN_LR, DECAY)


def assert_validated_at_parity_and_exported(run_dir, expected: dict, llama_dir, tmp_path):
    """The run's loss and gradient norm each step within 1e-5 of ``expected``'s, a validation logged, and its step-4
    checkpoint exported with ``--format peft`` loading onto the directory's model to ``expected``'s logits (1e-5).
    Returns the checkpoint."""
    metrics = run_dir / "metrics.csv"
    losses, norms = read_metric(metrics, "train/loss"), read_metric(metrics, "train/grad_norm")
    assert max_abs_diff(losses, expected["losses"]) < 1e-5, (losses, expected["losses"])
    assert max_abs_diff(norms, expected["grad_norms"]) < 1e-5, (norms, expected["grad_norms"])
    assert read_metric(metrics, "val/loss"), "no validation ran"
    checkpoint = next((run_dir / "checkpoints").glob("step-*4"))
    export = run_cli([str(BIN / "mgpu-export"), str(checkpoint), str(tmp_path / "adapter"), "--format", "peft"],
                     cwd=tmp_path)
    assert export.returncode == 0, (export.stdout + export.stderr)[-3000:]
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama_dir),
                                            tmp_path / "adapter")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - expected["model"](input_ids=ids).logits).abs().max() < 1e-5
    return checkpoint


def test_lora_from_the_command_line_at_parity_and_exported(llama_dir, token_file, tmp_path):
    run_dir = tmp_path / "run"
    data = [arg for arg in cli_args(token_file, STEPS) if arg not in TINY_MODEL and not arg.startswith("model.")]
    args = [str(BIN / "mgpu-train"), "model=hf", f"model.path={llama_dir}", *LORA, *data, "trainer.devices=4",
            "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1",
            "optim.lr=3e-3", "optim.weight_decay=0.1", "checkpoint.every_n_steps=4", "data.val_batches=1",
            f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    expected = reference(llama_dir, token_file)
    assert_validated_at_parity_and_exported(run_dir, expected, llama_dir, tmp_path)


def test_lora_on_the_last_layer_only_at_pp2(llama_dir, token_file, tmp_path):
    """Adapters on the second layer alone: pipeline rank 0 (embeddings, layer 0) trains nothing, and trains."""
    targets = ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    run_dir = tmp_path / "run"
    data = [arg for arg in cli_args(token_file, STEPS) if arg not in TINY_MODEL and not arg.startswith("model.")]
    args = [str(BIN / "mgpu-train"), "model=hf", f"model.path={llama_dir}", *LORA, f"adapters.targets=[{','.join(targets)}]",
            *data, "parallel.pipeline_parallel_size=2", "parallel.zero_stage=1", "optim.lr=3e-3",
            "optim.weight_decay=0.1", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    expected = reference(llama_dir, token_file, targets)
    metrics = run_dir / "metrics.csv"
    losses, norms = read_metric(metrics, "train/loss"), read_metric(metrics, "train/grad_norm")
    assert max_abs_diff(losses, expected["losses"]) < 1e-5, (losses, expected["losses"])
    assert max_abs_diff(norms, expected["grad_norms"]) < 1e-5, (norms, expected["grad_norms"])


def test_bad_adapter_settings_are_refused_before_launch(llama_dir):
    problems = "\n".join(config_problems(composed("model=hf", f"model.path={llama_dir}", "adapters=lora",
                                                  "adapters.rank=0", "adapters.dropout=1.5")))
    assert "adapters.rank=0 must be at least 1" in problems and "adapters.dropout=1.5" in problems, problems
    problems = "\n".join(config_problems(composed("model=hf", f"model.path={llama_dir}", "adapters=lora",
                                                  "adapters.targets=[q_proj,qkv]")))
    assert "adapters.targets: 'qkv' names no module" in problems and "q_proj'" not in problems, problems
    problems = "\n".join(config_problems(composed("adapters=lora", "adapters.targets=[wq,q_proj]")))
    assert "adapters.targets: 'q_proj' names no module of the model" in problems and "'wq'" not in problems, problems
    assert not config_problems(composed("adapters=lora", "adapters.targets=all-linear"))


#: transformers' Llama module -> the package's Llama module (written here from the two models' code, not from the
#: package's name table): the adapters' initial values are drawn from the names the package's model has.
OWN_NAMES = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
             "mlp.down_proj": "feed_forward.w2"}


def own_initial_values(model: torch.nn.Module) -> None:
    """The stated rule, with each adapter named as in the package's own model inside LLMModule
    (``model.layers.0.attention.wq.lora_A.default.weight``)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" not in name:
                continue
            layer, module = re.fullmatch(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_.*", name).groups()
            own = f"model.layers.{layer}.{OWN_NAMES[module]}." + name.split(f"{module}.", 1)[1]
            if ".lora_A." in name:
                g = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(own.encode()))
                bound = 1 / math.sqrt(param.shape[1])
                param.copy_(torch.rand(param.shape, generator=g) * 2 * bound - bound)
            else:
                param.zero_()


def test_lora_on_the_packages_own_model_from_a_pretrained_directory(llama_dir, token_file, tmp_path):
    """``adapters=lora`` without model=hf: PEFT's layers in the package's Llama, started from a transformers
    directory (``model.init_from``), split by tp2 + SP and pp2 (ZeRO-1; the norms, frozen, stay frozen), validated and
    checkpointed (the checkpoint holds what trains only), at one process's numbers; its adapters exported in PEFT's
    format load onto ``LlamaForCausalLM`` to the one-process model's logits; the head trained whole beside them
    (``modules_to_save=[output]``: PEFT's ``lm_head`` copy over transformers' model)."""
    run_dir = tmp_path / "run"
    args = [str(BIN / "mgpu-train"), *LORA, "adapters.modules_to_save=[output]", *cli_args(token_file, STEPS),
            f"model.init_from=hf:{llama_dir}",
            "trainer.devices=4", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
            "parallel.pipeline_parallel_size=2", "parallel.zero_stage=1", "optim.lr=3e-3", "optim.weight_decay=0.1",
            "checkpoint.every_n_steps=4", "data.val_batches=1", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, use_safetensors=True)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(OWN_NAMES),
                                                      modules_to_save=["lm_head"]))
    own_initial_values(model)
    expected = trained_like_the_cli(model, token_file, STEPS, LR, WARMUP, MIN_LR, DECAY)
    checkpoint = assert_validated_at_parity_and_exported(run_dir, expected, llama_dir, tmp_path)
    saved = [key for key in read_dcp_metadata(checkpoint).state_dict_metadata if key.startswith("param/")]
    head = "param/model.output.modules_to_save.default.weight"  # the trained copy; its frozen original left out
    assert sorted(saved) == sorted([key for key in saved if ".lora_" in key] + [head]) and len(saved) == 29, saved
