"""A ``transformers`` Qwen3-MoE directory trained as it is with its experts split (``mgpu-train model=hf
parallel.expert_parallel_size=2``): each rank reads only its experts' tensors from the directory's safetensors, the
run equals one process (loss and gradient norm within 1e-5), its universal checkpoint resumes at
``expert_parallel_size=1`` (2 -> 1) and at 4 (2 -> 4, on 4 ranks) on the same curve, and ``mgpu-export`` of it writes the model's own per-expert
names, which ``from_pretrained`` loads to the reference's logits."""

import json

import pytest
import torch
import transformers
from cli_helpers import BIN, TINY_MODEL, cli_args, read_metric, trained_like_the_cli
from forked_cli import run_cli
from helpers import max_abs_diff

STEPS = 4
LR, WARMUP, MIN_LR, DECAY = 3e-3, 2, 0.1, 0.1
EXPERTS, HIDDEN, EXPERT_HIDDEN, LAYERS = 8, 32, 16, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48,
                                         moe_intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(5)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def train(directory, token_file, run_dir, cwd, ep: int, steps: int, resume=None, devices: int = 2) -> str:
    args = [str(BIN / "mgpu-train"), "model=hf", f"model.path={directory}",
            *[a for a in cli_args(token_file, steps) if a not in TINY_MODEL and not a.startswith("model.")],
            f"trainer.devices={devices}", f"parallel.expert_parallel_size={ep}", "parallel.zero_stage=1", f"optim.lr={LR}",
            f"optim.weight_decay={DECAY}", "checkpoint.every_n_steps=2", f"hydra.run.dir={run_dir}"]
    if resume is not None:
        args.append(f"checkpoint.resume={resume}")
    proc = run_cli(args, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_expert_parallel_directory_reads_its_experts_resumes_at_ep1_and_exports(moe_dir, token_file, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, use_safetensors=True)
    expected = trained_like_the_cli(model, token_file, STEPS, LR, WARMUP, MIN_LR, DECAY)
    out = train(moe_dir, token_file, tmp_path / "ep2", tmp_path, ep=2, steps=STEPS)
    note = f"experts (Qwen3MoeForCausalLM): {LAYERS} blocks of {EXPERTS} experts, 4 on each rank of 2"
    assert note in out, out[-3000:]
    # rank 0 read every tensor but the other rank's experts: per layer 4 experts' gate and up [16, 32] and down
    # [32, 16] (ZeRO-1 partitions nothing while the model is built)
    whole = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(moe_dir).parameters())
    skipped = LAYERS * (EXPERTS // 2) * 3 * EXPERT_HIDDEN * HIDDEN
    assert f"rank 0 read {whole - skipped:,} of the model's {whole:,} parameter elements" in out, out[-3000:]
    metrics = tmp_path / "ep2" / "metrics.csv"
    assert max_abs_diff(read_metric(metrics, "train/loss"), expected["losses"]) < 1e-5
    assert max_abs_diff(read_metric(metrics, "train/grad_norm"), expected["grad_norms"]) < 1e-5
    # 2 -> 1: the step-2 checkpoint (experts saved as shards of the whole tensors) resumed with every expert on
    # every rank, on the same curve
    resumed = tmp_path / "ep1"
    train(moe_dir, token_file, resumed, tmp_path, ep=1, steps=STEPS,
          resume=str(tmp_path / "ep2" / "checkpoints" / "step-00000002"))
    again = read_metric(resumed / "metrics.csv", "train/loss")
    assert max_abs_diff(again[-2:], expected["losses"][2:]) < 1e-5, (again, expected["losses"])
    # 2 -> 4: the same checkpoint resumed on 4 ranks holding 2 experts each (the same global batches)
    train(moe_dir, token_file, tmp_path / "ep4", tmp_path, ep=4, steps=STEPS, devices=4,
          resume=str(tmp_path / "ep2" / "checkpoints" / "step-00000002"))
    wider = read_metric(tmp_path / "ep4" / "metrics.csv", "train/loss")
    assert max_abs_diff(wider[-2:], expected["losses"][2:]) < 1e-5, (wider, expected["losses"])
    # mgpu-export of the ep2 run's last checkpoint: one tensor per expert under the model's own names
    exported = run_cli([str(BIN / "mgpu-export"), str(tmp_path / "ep2" / "checkpoints" / "step-00000004"),
                        str(tmp_path / "out")], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    names = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]) \
        if (tmp_path / "out" / "model.safetensors.index.json").exists() else _names(tmp_path / "out")
    assert {f"model.layers.1.mlp.experts.{e}.{w}.weight" for e in range(EXPERTS)
            for w in ("gate_proj", "up_proj", "down_proj")} <= names, sorted(names)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_abs_diff(loaded(probe).logits.flatten().tolist(),
                            expected["model"](probe).logits.flatten().tolist()) < 1e-5


def _names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def test_the_dry_run_counts_the_split_experts_as_the_planner_does(moe_dir, token_file):
    """``dry_run=true`` at tp2 x ep2 (4 ranks): each built share holds 4 of 8 experts per layer, whole (2 layers x 4 x
    3 x 16 x 32 = 12,288 expert elements: worked by hand), and its dense and expert parameters equal the planner's."""
    from cli_helpers import composed

    from lightning_mgpu.cli.dry_run import dry_run_report, rank_shares
    from lightning_mgpu.cli.spec import run_spec
    from lightning_mgpu.planner.model_stats import rank_parameter_split

    args = [a for a in cli_args(token_file, STEPS) if a not in TINY_MODEL and not a.startswith("model.")]
    spec = run_spec(composed("model=hf", f"model.path={moe_dir}", *args, "trainer.devices=4",
                             "parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"), launching=False)
    layout, shares = rank_shares(spec)
    assert (layout.size("tp"), layout.size("ep"), layout.size("edp")) == (2, 2, 1)
    for share in shares:
        planned = rank_parameter_split(spec.model, 2, 1, ep=2)
        assert share.experts == LAYERS * (EXPERTS // 2) * 3 * EXPERT_HIDDEN * HIDDEN == planned.experts
        assert share.parameters - share.experts == planned.dense
    assert "experts: 4 of 8 (top-2) per rank" in dry_run_report(spec)
