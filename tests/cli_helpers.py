"""What the configuration tests and the end-to-end CLI tests share: composing a config as ``mgpu-train`` does, the
tiny run on the test token file with its single-process reference, and reading a run's metrics."""

import csv
import functools
import subprocess
import sys
from pathlib import Path

from forked_cli import entry_point, run_cli
from helpers import max_abs_diff, reference
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_mgpu.cli.config import register_configs
from lightning_mgpu.cli.paths import conf_dir
from lightning_mgpu.models import LlamaConfig

REPO = Path(__file__).resolve().parents[1]


BIN = Path(sys.executable).parent


def composed(*overrides, return_hydra_config=False):
    """The config ``mgpu-train`` composes from ``overrides``, with the schema and the recipes registered once per
    process: Hydra's config store keeps them, and registering again re-creates the same nodes, half the cost of a
    composition (about 0.3 s of CPU)."""
    _register_once()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


@functools.cache
def _register_once() -> None:
    register_configs()


def resolved(cfg):
    """The run of a composed config as a launch resolves it, without its rules (some tests ask only the memory check
    of a run that could not launch here, e.g. a SLURM job at submission)."""
    from lightning_mgpu.cli.run_data import resolve_data
    from lightning_mgpu.cli.run_model import resolve_model
    from lightning_mgpu.cli.spec import RunSpec

    data = resolve_data(cfg)
    return RunSpec.of(cfg, data, resolve_model(cfg, data))


def group_options(group):
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def read_metric(metrics: Path, key: str) -> list[float]:
    """The values of ``key`` in a run's metrics.csv, in step order."""
    rows = list(csv.DictReader(metrics.open()))
    return [float(r[key]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get(key)]


def read_losses(metrics: Path) -> list[float]:
    return read_metric(metrics, "train/loss")


def assert_cli_parity(metrics: Path, expected: dict) -> None:
    """A run's logged per-step loss and global grad norm equal the single-process reference to 1e-5."""
    assert max_abs_diff(read_losses(metrics), expected["losses"]) < 1e-5
    assert max_abs_diff(read_metric(metrics, "train/grad_norm"), expected["grad_norms"]) < 1e-5


TINY_MODEL = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.vocab_size=64",
              "model.max_seq_len=64"]


def cli_args(token_file, steps: int, n_layers: int = 2) -> list[str]:
    """A tiny run on the test token file, as in tests/helpers.py (seed 7, clip 0.3, 2 warm-up steps)."""
    return ["trainer.devices=2", "data=tokens", f"data.path={token_file}", "data.seq_len=16", "data.global_batch_size=8",
            "data.micro_batch_size=2", *TINY_MODEL, f"model.n_layers={n_layers}", f"trainer.max_steps={steps}",
            "trainer.gradient_clip_val=0.3", "optim.warmup_steps=2", "seed=7", "sample.prompt=0",
            "sample.max_new_tokens=4", "trainer.enable_progress_bar=false"]


#: The settings of the failure tests' runs: ZeRO-1, checkpoints every 2 steps, resumed automatically (they do not
#: change the losses: the uninterrupted run has them too).
RESTARTABLE = ["parallel.zero_stage=1", "checkpoint.every_n_steps=2", "checkpoint.resume=auto"]


def cli_reference(token_file, steps: int, n_layers: int = 2, val_batches: int = 0) -> dict:
    model = LlamaConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64,
                        max_seq_len=64)
    return reference(token_file, steps=steps, clip=0.3, model=model, seed=7, val_batches=val_batches,
                     optim=dict(lr=3e-3, warmup_steps=2, max_steps=steps, min_lr_ratio=0.1, weight_decay=0.1))


TINY_ARGS = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64",
             "model.vocab_size=64", "model.max_seq_len=64", "data.seq_len=16", "data.global_batch_size=8",
             "data.micro_batch_size=2", "trainer.enable_progress_bar=false", "sample.max_new_tokens=2",
             "sample.prompt=0", "optim.warmup_steps=2", "seed=7"]


def run(args, cwd, timeout=240, env=None, fork=True):
    """Run a command that must succeed; the package's console scripts are forked from this process (``forked_cli``)
    unless ``fork=False`` (a test that finds the run's processes by their command line)."""
    if fork and entry_point(str(args[0])) is not None:
        proc = run_cli(args, cwd=cwd, timeout=timeout, env=env)
    else:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


#: The ``config.json`` of each family a ``model=hf`` recipe is written for (no weights: the layout rules, the planner,
#: the memory check and the dry run read only the shape).
HF_FAMILIES = REPO / "tests" / "data" / "hf"


#: Fine-tuning recipes of a Hugging Face directory whose name does not say ``_hf_``: recipe -> the family it is written
#: for (the full fine-tune of "an 8B directory" is checked with Llama-3-8B's).
HF_RECIPE_FAMILIES = {"lora_qwen3_8b_1node": "qwen3_8b", "lora_llama3_70b_2node": "llama3_70b",
                      "finetune_8b_1node": "llama3_8b", "sft_8b_1node": "llama3_8b", "sft_lora_8b_1node": "qwen3_8b"}
#: Recipes of supervised fine-tuning (``data=sft``) and the conversations they are checked with: 40 short ones written
#: by ``mgpu-prepare --chat`` (tests/data/sft; its tokenizer is not kept, so a run could not decode a sample of it).
SFT_DATA = REPO / "tests" / "data" / "sft"
SFT_RECIPES = ("sft_8b_1node", "sft_lora_8b_1node")


def recipe_overrides(recipe: str) -> list[str]:
    """``recipe=NAME``, and for a recipe that trains a Hugging Face directory (``NAME`` = ``FAMILY_hf_...``, or one
    of :data:`HF_RECIPE_FAMILIES`) the ``model.path`` of its family's ``config.json``, as a user gives their
    download's; for a recipe of :data:`SFT_RECIPES` the ``data.path`` of prepared conversations."""
    family = HF_RECIPE_FAMILIES.get(recipe) or (recipe.split("_hf_")[0] if "_hf_" in recipe else None)
    data = [f"data.path={SFT_DATA}"] if recipe in SFT_RECIPES else []
    return [f"recipe={recipe}"] + ([f"model.path={HF_FAMILIES / family}"] if family else []) + data


@functools.lru_cache(maxsize=None)
def _searched(*args) -> tuple:
    from lightning_mgpu.planner import plan_layouts

    return tuple(plan_layouts(*args))


def search_once_per_shape(monkeypatch, *where: str) -> None:
    """Make the planner's search, looked up at each of ``where`` (``module.plan_layouts``), run once per set of
    arguments: reports that differ only in settings the search does not read (checkpointing, deadlines) share its
    rows."""
    for name in where:
        monkeypatch.setattr(name, lambda *args: list(_searched(*args)))


def trained_like_the_cli(model: "torch.nn.Module", token_file, steps: int, lr: float, warmup: int, min_lr: float,
                         decay: float) -> dict:
    """A ``model=hf`` run as a plain loop over what trains: the model's loss on the data module's global batches
    (inputs = all but the last token, every next token its target), AdamW with decay on matrices, the warm-up and
    cosine schedule, the global grad norm before clipping at 0.3. Each step's loss and grad norm, and the model."""
    import torch

    from helpers import global_batches
    from lightning_mgpu.lr_schedule import lr_multiplier

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), eps=1e-8)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, warmup, steps, min_lr))
    losses, norms = [], []
    for batch in global_batches(token_file, steps, global_batch=8, seq_len=16, seed=7):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = torch.nn.functional.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 0.3).item())
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "model": model}
