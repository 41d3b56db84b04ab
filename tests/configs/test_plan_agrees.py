"""Whatever ``mgpu-plan`` recommends, ``mgpu-train`` accepts: for every shipped model over cluster sizes and sequence
lengths, and for every recipe as it stands, every layout the planner's search returns and every command line
``mgpu-plan`` prints passes the launcher's own validation (``config_problems``, as a launch asks it)."""

import copy
import shlex

import pytest
import yaml
from cli_helpers import resolved
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lightning_mgpu.cli.config import register_configs
from lightning_mgpu.cli.paths import conf_dir
from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.cli.spec import config_problems
from lightning_mgpu.planner import GPUS, ClusterSpec, plan_layouts

MODELS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (conf_dir().parent / "recipes").glob("*.yaml"))
#: (nodes, GPUs per node, sequence length or None for the config's own)
CLUSTERS = [(1, 8, None), (2, 8, 8192)]
#: Mixture-of-experts shapes: their expert rules depend on the split sizes alone, which one node covers.
MOE_MODELS = {m for m in MODELS if "num_experts" in (conf_dir() / "model" / f"{m}.yaml").read_text()}
MODEL_CASES = [[f"model={m}", f"trainer.num_nodes={n}", f"trainer.devices={g}"]
               + ([f"data.seq_len={s}", f"model.max_seq_len={s}"] if s else []) for m in MODELS
               for n, g, s in (CLUSTERS[:1] if m in MOE_MODELS else CLUSTERS)]
RECIPE_CASES = [[f"recipe={r}"] for r in RECIPES]


def composed(overrides):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=list(overrides))


def refused(cfg) -> list[str]:
    """The launcher's verdict on a composed config, as ``mgpu-train`` asks it before starting anything."""
    return [str(p) for p in config_problems(cfg, launching=False)]


def _with(cfg, overrides):
    """``cfg`` with ``overrides`` set (in place: a layout's overrides replace every setting of the one before)."""
    out = cfg
    for override in overrides:
        key, value = override.split("=", 1)
        OmegaConf.update(out, key, yaml.safe_load(value), merge=False)
    return out


def _plan(overrides):
    cfg = composed(overrides)
    model = resolved(cfg).model
    cluster = ClusterSpec(cfg.trainer.num_nodes, cfg.trainer.devices, GPUS[cfg.plan.gpu])
    return cfg, plan_layouts(model, cluster, cfg.data.seq_len, cfg.data.global_batch_size, str(cfg.trainer.precision))


#: The settings that split a mixture-of-experts model (what its experts' rules depend on).
SPLIT = ("parallel.tensor_parallel_size=", "parallel.pipeline_parallel_size=", "parallel.context_parallel_size=",
         "parallel.expert_parallel_size=", "parallel.sequence_parallel=")


def _layout_key(overrides: list[str], experts: bool) -> tuple:
    """What two planned layouts must differ in to be checked apart: everything but the recompute mode (no rule looks
    at it beyond its name); for a mixture of experts, only its split: every rule that involves experts depends on the
    sizes alone, and every other setting is checked layout by layout on the dense models (1,140 distinct layouts of
    Mixtral on one node would take 23 s)."""
    if experts:
        return tuple(o for o in overrides if o.startswith(SPLIT))
    return tuple(o for o in overrides if not o.startswith("model.activation_checkpointing"))


@pytest.mark.parametrize("overrides", MODEL_CASES, ids=[" ".join(c) for c in MODEL_CASES])
def test_every_layout_the_search_returns_is_accepted(overrides):
    """Each layout's overrides set every layout setting, so one copy of the config takes them in turn."""
    cfg, rows = _plan(["trainer=gpu", "cluster=local", *overrides])
    assert rows, "the search returned no layout"
    seen, bad, changed = set(), [], copy.deepcopy(cfg)
    experts = resolved(cfg).model.num_experts > 0
    for row in rows:
        layout = _layout_key(row.candidate.overrides(), experts)
        if layout in seen:
            continue
        seen.add(layout)
        if problems := refused(_with(changed, row.candidate.overrides())):
            bad.append((row.candidate.overrides(), problems))
    assert not bad, f"{len(bad)} of {len(seen)} planned layouts refused, e.g. {bad[:2]}"


@pytest.mark.parametrize("overrides", MODEL_CASES + RECIPE_CASES, ids=[" ".join(c) for c in MODEL_CASES + RECIPE_CASES])
def test_every_command_mgpu_plan_prints_is_accepted(overrides):
    """The command lines, composed as ``mgpu-train`` composes them (the recipe's own settings underneath), and the
    table's rows on the recipe's config."""
    overrides = ["trainer=gpu", "cluster=local", *overrides]
    cfg, rows = _plan(overrides)
    changed = copy.deepcopy(cfg)
    for row in rows[: cfg.plan.top]:
        assert refused(_with(changed, row.candidate.overrides())) == [], row.candidate.overrides()
    report = plan_report(cfg, overrides)
    commands = [shlex.split(line.strip())[1:] for line in report.splitlines() if line.startswith("  mgpu-train ")]
    assert commands or "no layout fits" in report
    for command in commands:
        assert refused(composed(command)) == [], command
