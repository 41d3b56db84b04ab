"""Public names, registered strategies, precision and constructor errors: no processes needed."""

import ast
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mgpu
from lightning_mgpu import LLMModule, MGPUPrecision, MGPUStrategy
from lightning_mgpu.engine import deep_merge, evaluation_config, precision_config, zero_config
from lightning_mgpu.lr_schedule import lr_multiplier
from lightning_mgpu.module import scaled_lr
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.models import Llama, LlamaConfig


def test_registered_names():
    for name, stage in (("mgpu", 0), ("mgpu_zero1", 1), ("mgpu_zero2", 2), ("mgpu_zero3", 3),
                        ("mgpu_zero3_offload", 3)):
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, MGPUStrategy) and strategy.layout_request.zero_stage == stage
    offload = StrategyRegistry.get("mgpu_zero3_offload").layout_request
    assert offload.offload_optimizer == "cpu" and offload.offload_params == "cpu"


def test_unknown_strategy_name_is_clear():
    with pytest.raises(ValueError, match="mgpu_zero9"):
        L.Trainer(strategy="mgpu_zero9", accelerator="cpu", devices=1)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_supported_precisions(precision):
    MGPUPrecision(precision)
    config = precision_config(precision)
    assert ("bf16" in config) == precision.startswith("bf16")
    assert ("fp16" in config) == (precision == "16-mixed")
    if precision == "16-mixed":
        assert config["fp16"]["loss_scale"] == 0  # dynamic


def test_unknown_precision_names_the_accepted_ones():
    with pytest.raises(ValueError, match="precision='64-true' is not supported by MGPUStrategy; choose one of "
                                         "'32-true', 'bf16-mixed', 'bf16-true', '16-mixed'"):
        MGPUPrecision("64-true")


def test_trainer_precision_becomes_mgpu_precision():
    trainer = L.Trainer(strategy=MGPUStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(trainer.strategy.precision_plugin, MGPUPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(ValueError, match="precision='64-true'"):
        L.Trainer(strategy=MGPUStrategy(), accelerator="cpu", devices=1, precision="64-true")


def test_strategy_validates_before_launch():
    with pytest.raises(ValueError) as err:
        MGPUStrategy(zero_stage=5, offload_params="cpu")
    assert "zero_stage=5" in str(err.value) and "offload_params='cpu'" in str(err.value)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(pipeline_parallel_size=2, zero_stage=3, pipeline_schedule="zbv", virtual_pipeline_size=2),
     "zero_stage=3 cannot run pipeline_schedule='zbv'"),
    (dict(pipeline_parallel_size=4, num_microbatches=2), "needs num_microbatches >= pipeline_parallel_size=4"),
    (dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="1f1b"), "needs a multi-stage schedule"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"), "needs virtual_pipeline_size >= 2"),
])
def test_impossible_pipelines_are_refused_at_construction(kwargs, fragment):
    with pytest.raises(ValueError, match="Invalid parallel layout") as err:
        MGPUStrategy(**kwargs)
    assert fragment in str(err.value)


def test_sequence_parallel_without_tensor_parallel_is_refused_at_construction():
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_parallel_size > 1"):
        MGPUStrategy(sequence_parallel=True)


def test_deepspeed_config_buckets_from_model_and_overrides_merge():
    model = Llama(LlamaConfig())
    layout = ParallelLayout(world_size=2, zero_stage=3)
    cfg = zero_config(layout, model, 2, 4, 1.0, {"bf16": {"enabled": True}},
                      overrides={"zero_optimization": {"overlap_comm": True}, "steps_per_print": 5})
    z = cfg["zero_optimization"]
    # The documented rule: a quarter of the parameters, at least 2**17 elements. The default model holds, per layer,
    # wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 = 12288, w1/w2/w3 3*64*192 = 36864, two norms 128: 49280; four layers
    # 197120, plus embeddings and output 2*256*64 = 32768 and the final norm 64: 229952. A quarter (57488) is below
    # the floor, so the bucket is 2**17 = 131072.
    assert sum(p.numel() for p in model.parameters()) == 229952
    assert z["stage"] == 3 and z["reduce_bucket_size"] == 131072 and z["overlap_comm"] is True
    assert z["allgather_bucket_size"] == 131072 and z["stage3_prefetch_bucket_size"] == 131072
    # dim 128, ffn 384: per layer 128*128*2 + 128*64*2 = 49152, 3*128*384 = 147456, norms 256: 196864; four layers
    # 787456, plus 2*256*128 = 65536 and 128: 853120. A quarter, 213280, is above the floor and is the bucket.
    wider = Llama(LlamaConfig(dim=128, ffn_hidden=384))
    assert sum(p.numel() for p in wider.parameters()) == 853120
    assert zero_config(layout, wider, 2, 4, 1.0, {})["zero_optimization"]["reduce_bucket_size"] == 213280
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and cfg["steps_per_print"] == 5
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}
    # Overlap is the strategy's choice per device (on for CUDA), for the stages DeepSpeed overlaps (2 and 3); an engine
    # built to evaluate runs stage 0, which cannot.
    assert zero_config(layout, model, 2, 4, 1.0, {})["zero_optimization"]["overlap_comm"] is False
    assert zero_config(layout, model, 2, 4, 1.0, {}, overlap=True)["zero_optimization"]["overlap_comm"] is True
    for stage in (0, 1, 2):
        config = zero_config(ParallelLayout(world_size=2, zero_stage=stage), model, 2, 4, 1.0, {}, overlap=True)
        assert config["zero_optimization"]["overlap_comm"] is (stage == 2)
        assert evaluation_config(config)["zero_optimization"]["overlap_comm"] is False


def test_lr_schedule_warmup_then_cosine():
    assert lr_multiplier(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(55, 10, 100, 0.1) == pytest.approx(0.55)
    # Off the midpoint cosine and linear decay differ. Decay progress p = (step - 10) / 90, multiplier
    # 0.1 + 0.9 * (1 + cos(pi p)) / 2: p = 1/3 -> cos = 1/2 -> 0.775 (linear: 0.7); p = 2/3 -> cos = -1/2 -> 0.325
    # (linear: 0.4); p = 1/6 -> cos = sqrt(3)/2 -> 0.1 + 0.45 * 1.8660254 = 0.93971143 (linear: 0.85).
    assert lr_multiplier(40, 10, 100, 0.1) == pytest.approx(0.775)
    assert lr_multiplier(70, 10, 100, 0.1) == pytest.approx(0.325)
    assert lr_multiplier(25, 10, 100, 0.1) == pytest.approx(0.93971143)
    assert lr_multiplier(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_lr_scaling_rules():
    assert scaled_lr(1e-3, "linear", 64, 32) == pytest.approx(2e-3)
    assert scaled_lr(1e-3, "sqrt", 64, 32) == pytest.approx(1e-3 * math.sqrt(2))
    assert LLMModule("tiny", lr=1e-3, lr_scaling="linear", reference_batch_size=8, global_batch_size=32).peak_lr == \
        pytest.approx(4e-3)
    with pytest.raises(ValueError, match="needs global_batch_size and optim.reference_batch_size"):
        scaled_lr(1e-3, "linear", 64, None)
    with pytest.raises(ValueError, match="optim.lr_scaling='cubic' is unknown"):
        scaled_lr(1e-3, "cubic", 64, 32)


def test_llm_module_declares_every_hook_of_the_contract_and_builds_shards_from_names():
    from lightning_mgpu import ParallelModule
    from lightning_mgpu.models.llama import Llama

    module = LLMModule("tiny", init_seed=3)
    assert isinstance(module, ParallelModule)
    whole = Llama(module.config, init_seed=3)
    weight = dict(whole.named_parameters())["layers.1.attention.wq.weight"]
    # Any slice of the initial value is the slice of the whole-built tensor: shards start from the same weights.
    part = module.initial_value("model.layers.1.attention.wq.weight", weight.shape, (slice(8, 16), slice(None)))
    assert torch.equal(part, weight.detach()[8:16])
    with torch.device("meta"):
        assert Llama(module.config).output.weight.is_meta  # nothing allocated, nothing initialised


def _imports(path: Path) -> list[str]:
    """The absolute module names a source file imports, at any depth (module level or inside functions)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _package_files() -> dict[str, Path]:
    package = Path(lightning_mgpu.__file__).parent
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _importers_of(prefix: str) -> list[str]:
    return [name for name, path in _package_files().items()
            if any(n == prefix or n.startswith(prefix + ".") for n in _imports(path))]


def test_only_the_engine_package_imports_deepspeed():
    """DeepSpeed sits behind ``lightning_mgpu.engine``: no other module of the package imports it."""
    importers = _importers_of("deepspeed")
    assert importers and all(p.startswith("lightning_mgpu.engine") for p in importers), importers


def test_shipped_code_never_imports_the_test_harness():
    """``lightning_mgpu.testing`` (the fork harness and probes) serves tests and benchmarks; fault injection that
    ``mgpu-train`` ships is ``lightning_mgpu.resilience.faults``."""
    assert _importers_of("lightning_mgpu.testing") == []
    assert _importers_of("lightning_mgpu.resilience.faults")  # the chaos hook is wired in


def test_everything_that_knows_hugging_face_sits_in_hf():
    """One home for Hugging Face: no module outside ``lightning_mgpu.hf`` imports ``transformers`` or ``peft`` or is
    named for Hugging Face (as ``checkpoint/hf*.py`` once were), and ``hf`` imports neither training module's file
    (``lightning_mgpu.module`` imports ``hf`` to read Llama weights)."""
    outside = {name: [m for m in _imports(path) if m.split(".")[0] in ("transformers", "peft")]
               for name, path in _package_files().items() if _package_of(name) != "hf"}
    assert not {k: v for k, v in outside.items() if v}, {k: v for k, v in outside.items() if v}
    named = [name for name in _package_files() if _package_of(name) != "hf" and "hf" in name.split(".")[-1].split("_")]
    assert named == [], named
    assert "module" not in _package_graph()["hf"], sorted(_package_graph()["hf"])


def test_no_import_cycle_between_modules():
    """Module A importing B (at any depth) and B importing A back, directly or through others, is refused; a
    package's ``__init__`` re-exporting its own modules does not count."""
    files = _package_files()
    graph = {name: {m for m in _imports(path) if m in files and m != name and not name.startswith(m + ".")
                    and not (path.name == "__init__.py" and m.startswith(name + "."))}
             for name, path in files.items()}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _package_of(module: str) -> str:
    """``lightning_mgpu.parallel.tensor`` -> ``parallel``; a top-level module is its own package (``strategy``)."""
    return module.split(".")[1] if "." in module else module


def _package_graph() -> dict[str, set[str]]:
    """Package -> the packages its modules import (at any depth), each package a folder of the package or a
    top-level module."""
    graph: dict[str, set[str]] = {}
    files = _package_files()
    for name, path in files.items():
        if name == "lightning_mgpu":
            continue
        source = _package_of(name)
        targets = {_package_of(m) for m in _imports(path) if m.startswith("lightning_mgpu.") and m in files}
        graph.setdefault(source, set()).update(targets - {source})
    return graph


def test_no_import_cycle_between_packages():
    """The modules of one folder (``engine``, ``parallel``, ``checkpoint``, ...) form a layer: no folder imports one
    that imports it back, directly or through others (the module-level test above cannot see ``engine.a -> parallel.b
    -> engine.c``)."""
    graph = _package_graph()
    reach = {p: set(graph.get(p, ())) for p in graph}
    changed = True
    while changed:
        changed = False
        for p in reach:
            grown = reach[p].union(*(reach.get(q, set()) for q in reach[p]))
            if grown != reach[p]:
                reach[p], changed = grown, True
    cycles = sorted(f"{p} -> {q} -> {p}" for p in reach for q in graph.get(p, ()) if p in reach.get(q, set()))
    assert not cycles, cycles


def _reached_from(package: str) -> set[str]:
    """Every package ``package``'s modules import, directly or through other packages."""
    graph = _package_graph()
    reached, todo = set(), [package]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    return reached


def test_failure_handling_imports_nothing_above_it():
    """Detection, agreement, preemption, restarts and the chaos hooks live in ``resilience``, which the checkpoint code,
    the parallel layers, the strategy and the CLI import: it reaches none of them back (only the problem formatter)."""
    moved = ["liveness", "watchdog", "collective_trace", "stragglers", "agreement", "preemption", "restarts",
             "elastic", "faults", "step_guard", "rollback", "fingerprint"]
    files = _package_files()
    assert all(f"lightning_mgpu.resilience.{m}" in files for m in moved), sorted(files)
    assert _reached_from("resilience") <= {"problems"}, sorted(_reached_from("resilience"))


def test_the_planner_imports_nothing_distributed():
    """The planner runs on a laptop for a cluster it is not on: none of its modules imports the parallel layers, the
    engine, DeepSpeed or torch.distributed, directly or through other packages of the package."""
    reached = _reached_from("planner")
    assert not reached & {"parallel", "engine", "strategy", "checkpoint", "hf"}, sorted(reached)
    files = _package_files()
    modules = [name for name in files if _package_of(name) in reached | {"planner"} and name != "lightning_mgpu"]
    distributed = {name: [m for m in _module_level_imports(files[name]) if m.startswith(("torch.distributed",
                                                                                         "deepspeed"))]
                   for name in modules}
    assert not any(distributed.values()), {k: v for k, v in distributed.items() if v}


def _module_level_imports(path: Path) -> list[str]:
    """What importing the module imports (its top-level statements; a function may import lazily what only a running
    job needs, as the layout's process-group creation does)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append(node.module)
    return out


def test_the_package_stays_small_enough_to_read():
    """No module over 400 lines, no function over 50, and the strategy (Lightning's hooks, each delegating) at most
    300."""
    too_long, functions = [], []
    for name, path in _package_files().items():
        lines = path.read_text().splitlines()
        if len(lines) > (300 if name == "lightning_mgpu.strategy" else 400):
            too_long.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long and not functions, too_long + functions


def test_every_package_folder_ships_in_the_wheel():
    """A folder of the package missing from pyproject's explicit list installs nowhere: a non-editable install then
    fails on its first import (an editable one hides it, its finder falling back to the source tree)."""
    import tomllib

    listed = set(tomllib.loads((Path(lightning_mgpu.__file__).parents[1] / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _package_files().items() if path.name == "__init__.py"}
    assert folders - listed == set(), sorted(folders - listed)
