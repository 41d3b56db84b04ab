"""``mgpu-train model=hf model.path=DIR``: a ``transformers`` directory trained as it is from the command line, with
validation and checkpoints, at parity with one process; its dry run, the planner and the memory check read its shape
from ``config.json`` (a 70B-class config without weights), and a layout its shape forbids is refused before launch."""

import json
import shlex

import pytest
import torch
import transformers
from cli_helpers import BIN, TINY_MODEL, cli_args, composed, read_metric, trained_like_the_cli
from forked_cli import run_cli
from helpers import max_abs_diff

from lightning_mgpu.cli.machine import machine_problems
from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.cli.spec import config_problems
from lightning_mgpu.hf.names import from_hf_config, planning_shape
from lightning_mgpu.planner import GPUS, ClusterSpec
from lightning_mgpu.planner.model_stats import rank_parameter_split
from lightning_mgpu.planner.search import candidates

STEPS = 4
LR, WARMUP, MIN_LR, DECAY = 3e-3, 2, 0.1, 0.1


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(5)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    (directory / "chat_template.jinja").write_text("{{ messages }}")  # a tokenizer's file the export carries over
    return directory


def reference(directory, token_file) -> dict:
    """The same run as a plain loop (``trained_like_the_cli``) of the directory's model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, use_safetensors=True)
    return trained_like_the_cli(model, token_file, STEPS, LR, WARMUP, MIN_LR, DECAY)


def data_and_trainer(token_file) -> list[str]:
    """The tiny CLI run's settings (``cli_args``) without the package model's shape: ``model=hf`` refuses those."""
    return [arg for arg in cli_args(token_file, STEPS) if arg not in TINY_MODEL and not arg.startswith("model.")]


def test_a_transformers_directory_trains_as_it_is_at_parity(qwen3_dir, token_file, tmp_path):
    run_dir = tmp_path / "run"
    args = [str(BIN / "mgpu-train"), "model=hf", f"model.path={qwen3_dir}", *data_and_trainer(token_file),
            "trainer.devices=4", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
            "model.activation_checkpointing=selective",
            "parallel.zero_stage=1", "optim.lr=3e-3", "optim.weight_decay=0.1", "data.val_batches=1",
            "checkpoint.every_n_steps=2", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "tensor parallel over 2 ranks" in out and "sequence parallel" in out, out[-3000:]
    assert "activation checkpointing: selective on 2 blocks" in out, out[-3000:]
    # Built on the meta device, rank 0 read only its slices (tp rank 0 of 2, ZeRO-1 partitions nothing at build):
    # the vocabulary-split embedding and head 32 * 32 each, the final norm 32; per layer q 16 * 32, k and v 8 * 32,
    # o 32 * 16, q/k norms 8 each, gate and up 32 * 32, down 32 * 32, two norms of 32: 4688. Whole: 22,720.
    assert f"rank 0 read {1024 + 1024 + 32 + 2 * 4688:,} of the model's 22,720 parameter elements" in out, out[-3000:]
    expected = reference(qwen3_dir, token_file)
    metrics = run_dir / "metrics.csv"
    assert max_abs_diff(read_metric(metrics, "train/loss"), expected["losses"]) < 1e-5
    assert max_abs_diff(read_metric(metrics, "train/grad_norm"), expected["grad_norms"]) < 1e-5
    assert read_metric(metrics, "val/loss"), "no validation ran"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    # mgpu-export of the last checkpoint (universal, written by tp2 x dp2): what from_pretrained loads, in shards of
    # at most 20 KB (25 tensors: 11 per layer, the embedding, the norm and the head; 22,720 fp32 elements, 90,880 bytes),
    # the trained model's logits
    exported = run_cli([str(BIN / "mgpu-export"), str(run_dir / "checkpoints" / "step-00000004"), str(tmp_path / "out"),
                        "--max-shard-size", "20KB"], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and len(index["weight_map"]) == 25, index
    assert index["metadata"]["total_size"] == 22_720 * 4, index
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert "out '" in run_cli([str(BIN / "mgpu-export"), str(run_dir / "checkpoints" / "step-00000004"),
                               str(qwen3_dir)], cwd=tmp_path).stderr  # never over the directory it trained from
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_abs_diff(loaded(probe).logits.flatten().tolist(),
                            expected["model"](probe).logits.flatten().tolist()) < 1e-5


LLAMA_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def write_70b(directory):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_70B))
    return directory


#: Qwen3-30B-A3B's published shape (128 experts, 8 a token).
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "tie_word_embeddings": False, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}


def test_a_transformers_mixture_of_experts_is_planned_with_its_experts_split(tmp_path):
    """Qwen3-30B-A3B's experts are split by expert parallelism (lightning_mgpu.hf.expert_parallel): the planner's
    search tries 1, 2, 4 and 8 as for the package's own MoE of the same shape, a rank's routed experts are counted
    E / Ep of them (48 layers x 128 experts x 3 x 2048 x 768, halved at ep2: worked by hand), every command mgpu-plan
    prints is accepted, and mgpu-train accepts 2 before launch; GraniteMoE, whose experts are not split, is refused 2
    naming the families that are."""
    cluster = ClusterSpec(1, 8, GPUS["h100_80gb"])
    as_is, own = planning_shape(QWEN3_30B_A3B), from_hf_config(QWEN3_30B_A3B)
    assert {c.ep for c in candidates(as_is, cluster, 64, 4096)} == {1, 2, 4, 8}
    assert {c.ep for c in candidates(own, cluster, 64, 4096)} == {1, 2, 4, 8}
    routed = 48 * 128 * 3 * 2048 * 768
    whole, halved = rank_parameter_split(as_is, 1, 1, ep=1), rank_parameter_split(as_is, 1, 1, ep=2)
    assert (whole.experts, halved.experts) == (0, routed // 2)
    assert whole.dense - halved.dense == routed
    directory = tmp_path / "qwen3_30b_a3b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    overrides = ["trainer=gpu", "cluster=local", "model=hf", f"model.path={directory}", "trainer.num_nodes=1",
                 "trainer.devices=8", "data.seq_len=4096"]
    report = plan_report(composed(*overrides), overrides)
    commands = [shlex.split(line)[1:] for line in report.splitlines() if line.startswith("  mgpu-train ")]
    assert commands, report
    for command in commands:
        assert config_problems(composed(*command), launching=False) == [], command
    accepted = config_problems(composed(*overrides, "parallel.expert_parallel_size=2"), launching=False)
    assert not [problem for problem in accepted if "expert_parallel_size" in problem], accepted
    granite = tmp_path / "granitemoe"
    granite.mkdir()
    (granite / "config.json").write_text(json.dumps(transformers.GraniteMoeConfig(
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, hidden_size=64, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256).to_dict()))
    refused = config_problems(composed(*overrides[:3], f"model.path={granite}", "trainer.devices=2",
                                       "parallel.expert_parallel_size=2"), launching=False)
    assert any("parallel.expert_parallel_size=2 cannot split the 8 experts of this transformers mixture of experts"
               in problem and "qwen3_moe, mixtral, gpt_oss, deepseek_v3 models only" in problem
               for problem in refused), refused


def test_every_command_mgpu_plan_prints_for_a_directory_is_accepted(tmp_path):
    """Whatever mgpu-plan recommends for a transformers directory, mgpu-train accepts (recomputation included)."""
    directory = write_70b(tmp_path / "llama70b")
    overrides = ["trainer=gpu", "cluster=local", "model=hf", f"model.path={directory}", "trainer.num_nodes=8",
                 "trainer.devices=8", "data.seq_len=8192"]
    report = plan_report(composed(*overrides), overrides)
    commands = [shlex.split(line.strip())[1:] for line in report.splitlines() if line.startswith("  mgpu-train ")]
    assert commands, report
    for command in commands:
        assert config_problems(composed(*command), launching=False) == [], command


def test_a_70b_config_dry_runs_on_the_meta_device_and_bad_layouts_are_refused(tmp_path):
    """No weights at all: the dry run builds every distinct rank's share of the transformers model on the meta
    device from config.json; 70.6 B parameters over tp8 x pp8 (8 ranks hold a stage each of 10 layers)."""
    directory = write_70b(tmp_path / "llama70b")
    base = [str(BIN / "mgpu-train"), "model=hf", f"model.path={directory}", "trainer=gpu", "trainer.num_nodes=8",
            "trainer.devices=8", "data.seq_len=8192", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_cli(base + ["parallel.tensor_parallel_size=8", "parallel.pipeline_parallel_size=8",
                           "parallel.zero_stage=1", "parallel.num_microbatches=8"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "64 processes = tp 8 x pp 8 x dp 1" in proc.stdout, proc.stdout[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 0 |")]
    assert len(rows) == 8, proc.stdout[-3000:]
    # every layer's weights split 8 ways: 80 layers / 8 stages x (4 * 8192^2 * 10/64 ... ) -- counted by hand below
    per_layer = (8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672) // 8 + 2 * 8192
    middle = int(rows[1].split("|")[4].replace(",", ""))
    assert middle == 10 * per_layer, (middle, 10 * per_layer)
    bad = run_cli(base + ["parallel.tensor_parallel_size=3"], cwd=tmp_path)
    assert bad.returncode == 2 and "parallel.tensor_parallel_size=3" in bad.stderr, bad.stderr[-3000:]


def test_context_parallelism_of_a_sliding_window_is_refused_before_launch(tmp_path):
    directory = tmp_path / "mistral"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA_70B, "model_type": "mistral", "sliding_window": 4096}))
    problems = config_problems(composed("trainer=gpu", "cluster=local", "model=hf", f"model.path={directory}",
                                        "trainer.devices=8", "data.seq_len=8192", "parallel.context_parallel_size=2",
                                        "parallel.pipeline_parallel_size=2"), launching=False)
    assert any("parallel.context_parallel_size=2 cannot split a model that attends within a sliding window "
               "(sliding_window=4096)" in p for p in problems), problems
    assert any("parallel.context_parallel_size=2 with parallel.pipeline_parallel_size=2: a transformers model's "
               "pipeline stages" in p for p in problems), problems
    # what this machine lacks: the weights (a dry run, which asks nothing of the machine, lays out config.json alone)
    lacking = machine_problems(composed("trainer=cpu", "cluster=local", "model=hf", f"model.path={directory}"))
    assert any(f"model.path={str(directory)!r} has no *.safetensors weights" in p for p in lacking), lacking


def test_a_tied_head_refused_pipeline_stages_names_the_directory_and_no_untying(tmp_path):
    """A tied head is refused pipeline stages by the directory's own key; untying is not offered (its files hold no
    head of their own)."""
    directory = tmp_path / "gemma"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA_70B, "tie_word_embeddings": True}))
    problems = config_problems(composed("trainer=gpu", "cluster=local", "model=hf", f"model.path={directory}",
                                        "trainer.devices=8", "parallel.pipeline_parallel_size=2"), launching=False)
    assert [p for p in problems if "tie" in p] == [
        f"{directory}/config.json: tie_word_embeddings=True cannot be split into pipeline stages (the embedding lives "
        "on the first stage, the head on the last); this model's head is its embedding; set "
        "parallel.pipeline_parallel_size=1"], problems


def test_a_directory_without_a_tokenizer_prints_no_sample_rather_than_bytes(tmp_path):
    """The end-of-run sample encodes its prompt with the run's tokenizer; a transformers directory without one has no
    way to write it in the model's tokens (bytes would be other tokens, or beyond a small vocabulary)."""
    from lightning_mgpu.cli.spec import run_spec
    from lightning_mgpu.cli.train import no_sample_reason

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    hf = run_spec(composed("model=hf", f"model.path={tmp_path}", "trainer=gpu", "trainer.devices=2"), launching=False)
    assert no_sample_reason(hf) == (f"{tmp_path} has no tokenizer.json and data.tokenizer is not set, so the prompt "
                                    "cannot be written in this model's tokens")
    assert no_sample_reason(run_spec(composed(), launching=False)) is None  # the package's model, on byte tokens
