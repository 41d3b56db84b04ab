"""Every private name of another library that lightning_mgpu relies on, looked up here against the installed versions:
an upgrade that renames or removes one fails in this one place, naming the name, where it is used, and the versions
pinned in pyproject.toml, instead of deep inside a multi-process run (or, for a ``getattr`` with a default, silently).

Names a class sets on its instances (``self._x = ...``) cannot be looked up without building one: for those the
library's source must still assign them. The lists below say where each name is used; the tests at the end find the
names by parsing the package's source, with no list: every private import and every private name reached through a
library's module or class is looked up, every private attribute read or written on another library's objects must
still be named in torch's, Lightning's, DeepSpeed's or transformers' source, and every private method the package
overrides must be marked ``@override`` and still be a base class's. Broken once each (2026-12-06): torch_muon._adjust_lr
renamed in optim/muon.py, ``self._opt_called`` renamed there, ``_check_log_dir_exists`` renamed in
cli/metrics_history.py: each failed its test with the file, the line and the pinned versions."""

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Optional

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
PACKAGE = PYPROJECT.parent / "lightning_mgpu"

#: (distribution, "module:attribute.path" to look up, where lightning_mgpu uses it)
ATTRIBUTES = [
    ("torch", "torch:_grouped_mm", "models/moe.py grouped_matmul"),
    ("torch", "torch._C:_current_graph_task_id", "models/moe.py Router.forward"),
    ("torch", "torch._C._distributed_c10d:_dump_fr_trace_json", "resilience/collective_trace.py"),
    ("torch", "torch._dynamo:list_backends", "parallel/compile.py"),
    ("torch", "torch.distributed._functional_collectives:all_to_all_single_autograd", "parallel/experts.py"),
    ("torch", "torch.distributed._functional_collectives:wait_tensor", "parallel/experts.py"),
    ("torch", "torch.distributed.distributed_c10d:_get_default_store", "resilience/liveness.py"),
    ("torch", "torch.distributed.distributed_c10d:_abort_process_group", "resilience/strikes.py (the abort fault)"),
    ("torch", "torch.distributed:Work._source_rank", "parallel/replica_server.py"),
    ("torch", "torch.distributed.checkpoint.filesystem:_StorageInfo", "checkpoint/safe_reader.py"),
    ("torch", "torch.distributed.checkpoint.filesystem:FileSystemReader._get_metadata_path",
     "checkpoint/safe_reader.py"),
    ("torch", "torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING", "checkpoint/safe_reader.py"),
    ("torch", "torch.serialization:_get_layout", "checkpoint/safe_reader.py"),
    ("torch", "torch.optim:_muon", "optim/muon.py"),
    ("torch", "torch.optim._muon:_zeropower_via_newtonschulz", "optim/muon.py orthogonalize (torch.optim.Muon's bits)"),
    ("torch", "torch.optim._muon:_adjust_lr", "optim/muon.py orthogonalize"),
    ("torch", "torch.optim._muon:DEFAULT_A", "optim/muon.py MUON_DEFAULTS"),
    ("torch", "torch.distributed.checkpoint.staging:AsyncStager._synchronize_after_execute",
     "checkpoint/background.py (overridden)"),
    ("torch", "torch.distributed.pipelining.schedules:_Action", "parallel/pipeline.py"),
    ("torch", "torch.distributed.pipelining.schedules:_add_send_recv", "parallel/pipeline.py"),
    ("torch", "torch.distributed.pipelining.schedules:_ComputationType.FORWARD", "parallel/pipeline.py"),
    ("torch", "torch.distributed.pipelining.schedules:_PipelineScheduleRuntime", "parallel/pipeline.py"),
    ("torch", "torch.distributed.pipelining:PipelineStage._forward_metadata_inference", "parallel/pipeline.py"),
    ("torch", "torch.autograd.profiler:_is_profiler_enabled", "parallel/pipeline.py name_actions"),
    ("torch", "torch.distributed.pipelining.schedules:_get_profiler_function_name", "parallel/pipeline.py name_actions"),
    ("torch", "torch.distributed.pipelining.schedules:_ComputationType.from_str", "parallel/pipeline.py name_actions"),
    ("torch", "torch.cuda.memory:_record_memory_history", "callbacks/profile.py"),
    ("torch", "torch.cuda.memory:_dump_snapshot", "callbacks/profile.py"),
    ("torch", "torch.nn:Module._apply", "models/moe.py Router (overridden)"),
    ("torch", "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
     "resilience/elastic.py (overridden)"),
    ("torch", "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._shutdown",
     "resilience/elastic.py (overridden)"),
    ("lightning", "lightning.fabric.utilities.distributed:_distributed_is_initialized", "parallel/collectives.py"),
    ("lightning", "lightning.fabric.utilities.distributed:_sync_ddp_if_available", "parallel/collectives.py"),
    ("lightning", "lightning.fabric.utilities.distributed:_get_default_process_group_backend_for_device",
     "parallel/process_group.py"),
    ("lightning", "lightning.fabric.utilities.distributed:_init_dist_connection", "parallel/process_group.py"),
    ("lightning", "lightning.pytorch.core.optimizer:_init_optimizers_and_lr_schedulers", "strategy.py"),
    ("lightning", "lightning.pytorch.strategies.launchers:_SubprocessScriptLauncher._call_children_scripts",
     "launcher.py (overridden)"),
    ("lightning", "lightning.pytorch.strategies.launchers:_SubprocessScriptLauncher._check_can_spawn_children",
     "launcher.py"),
    ("lightning", "lightning.pytorch.strategies:Strategy._configure_launcher", "strategy.py (overridden)"),
    ("lightning", "lightning.pytorch.plugins.precision:Precision._after_closure", "precision.py"),
    ("lightning", "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor",
     "resilience/preemption.py, parallel/replicas.py (replaced per instance)"),
    ("lightning", "lightning.pytorch.callbacks:ModelSummary._summary", "callbacks/console.py (overridden)"),
    ("lightning", "lightning.pytorch.utilities.model_summary:ModelSummary._get_summary_data", "callbacks/console.py"),
    ("lightning", "lightning.pytorch.utilities.model_summary.model_summary_deepspeed:DeepSpeedSummary",
     "callbacks/console.py"),
    ("lightning", "lightning.pytorch.callbacks:RichProgressBar._get_train_description",
     "callbacks/console.py (overridden)"),
    ("deepspeed", "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP", "engine/experts.py"),
    ("deepspeed", "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP", "engine/experts.py"),
    ("deepspeed", "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP_RANKS", "engine/experts.py"),
    ("deepspeed", "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP_RANKS", "engine/experts.py"),
    ("deepspeed", "deepspeed.module_inject.auto_ep_layer:AutoEPMoELayer.set_deepspeed_parallelism",
     "engine/experts.py (subclassed)"),
    ("deepspeed", "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._grad_norm_counts_every_rank",
     "engine/experts.py, engine/runtime.py"),
    ("deepspeed", "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group",
     "engine/experts.py"),
    ("deepspeed", "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._partition_all_parameters",
     "engine/master_weights.py"),
    ("deepspeed",
     "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters",
     "engine/master_weights.py"),
    ("deepspeed", "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
     "engine/parameter_state.py"),
    ("transformers", "transformers.modeling_utils:PreTrainedModel._init_weights", "hf/weights.py real_buffers"),
    ("submitit", "submitit.slurm.slurm:_convert_mem", "cli/slurm.py"),
    ("submitit", "submitit.slurm.slurm:_make_sbatch_string", "cli/slurm.py"),
    ("submitit", "submitit.slurm.slurm:SlurmExecutor._equivalence_dict", "cli/slurm.py"),
    ("submitit", "submitit.core._submit:__name__", "cli/slurm.py (the command sbatch runs)"),
    ("torchao", "torchao.float8.float8_training_tensor:hp_tensor_and_scale_to_float8", "fp8/scaling.py cast"),
    ("torchao", "torchao.float8.float8_training_tensor:GemmInputRole", "fp8/scaling.py"),
    ("torchao", "torchao.float8.float8_training_tensor:LinearMMConfig", "fp8/scaling.py Fp8Spec.mm_config"),
    ("torchao", "torchao.float8.float8_training_tensor:ScaledMMConfig", "fp8/scaling.py Fp8Spec.mm_config"),
    ("torchao", "torchao.float8.float8_utils:tensor_to_amax", "fp8/scaling.py reduced_amax"),
    ("torchao", "torchao.float8.float8_utils:amax_to_scale", "fp8/scaling.py, fp8/grouped.py"),
    ("torchao", "torchao.float8.float8_utils:to_fp8_saturated", "fp8/grouped.py"),
    ("torchao", "torchao.float8.float8_scaling_utils:get_maybe_axiswise_dim", "fp8/scaling.py cast"),
    ("python", "pickle:_Unpickler.dispatch", "checkpoint/safe_reader.py"),
    ("python", "atexit:_run_exitfuncs", "resilience/elastic.py"),
    ("python", "weakref:finalize._registry", "resilience/elastic.py"),
]
#: (distribution, module whose source must assign the instance attribute, "self.<name> =" or similar, where used)
ASSIGNED = [
    ("torch", "torch.distributed.pipelining.schedules", "self._stages =", "parallel/pipeline.py"),
    ("torch", "torch.distributed.pipelining.schedules", "self._num_stages =", "parallel/pipeline.py"),
    ("torch", "torch.nn.modules.module", "_non_persistent_buffers_set", "checkpoint/universal.py"),
    ("torch", "torch.optim.lr_scheduler", "self._last_lr =", "engine/experts.py"),
    ("torch", "torch.distributed.elastic.agent.server.api", "self._remaining_restarts =", "resilience/elastic.py"),
    ("lightning", "lightning.pytorch.strategies.strategy", "self._launcher:", "strategy.py"),
    ("lightning", "lightning.pytorch.strategies.strategy", "self._forward_redirection:", "strategy.py"),
    ("lightning", "lightning.pytorch.callbacks.timer", "self._duration =", "refusals.py"),
    ("lightning", "lightning.pytorch.callbacks.model_summary", "self._max_depth:", "callbacks/console.py"),
    ("lightning", "lightning.pytorch.callbacks.progress.rich_progress", "self._refresh_rate:", "callbacks/console.py"),
    ("lightning", "lightning.pytorch.callbacks.progress.rich_progress", "self._leave:", "callbacks/console.py"),
    ("lightning", "lightning.pytorch.callbacks.progress.rich_progress", "self._console_kwargs =",
     "callbacks/console.py"),
    ("deepspeed", "deepspeed.runtime.engine", "self._global_grad_norm =", "engine/runtime.py"),
    ("deepspeed", "deepspeed.runtime.zero.stage_1_and_2", "self._hp_optimizer_states_linked =",
     "engine/parameter_state.py"),
    ("deepspeed", "deepspeed.utils.mixed_precision_linkage", "lp_param._hp_mapping =", "engine/pieces.py"),
    ("deepspeed", "deepspeed.utils.mixed_precision_linkage", "lp_param._dp_group =", "engine/pieces.py"),
    ("transformers", "transformers.modeling_utils", "self._pp_plan", "hf/stages.py"),
    ("transformers", "transformers.modeling_utils", "self._tp_plan", "hf/tensor_plan.py"),
]
#: (module:function, the keyword parameters lightning_mgpu passes it)
KEYWORDS = [
    ("torch.distributed.pipelining.schedules:_add_send_recv", ("stage_to_rank", "num_stages")),
]


def versions(distribution: str) -> str:
    """The installed version of ``distribution`` and what pyproject.toml asks for, for the failure message."""
    if distribution == "python":
        return f"Python {sys.version.split()[0]}"
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    pinned = sorted({str(r.specifier) or "any" for r in map(Requirement, specs) if r.name == distribution})
    if distribution == "submitit":  # through hydra-submitit-launcher, pinned
        pinned = [f"via hydra-submitit-launcher {s}" for s in
                  sorted({str(r.specifier) for r in map(Requirement, specs) if r.name == "hydra-submitit-launcher"})]
    return f"{distribution} {importlib.metadata.version(distribution)} installed, pyproject.toml pins " \
           f"{', '.join(pinned) or 'nothing'}"


def look_up(spec: str) -> Any:
    """``module:attribute.path`` -> the object."""
    module, _, path = spec.partition(":")
    found: Any = importlib.import_module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found


@pytest.mark.parametrize("distribution, spec, where", ATTRIBUTES, ids=[a[1] for a in ATTRIBUTES])
def test_private_name_exists(distribution: str, spec: str, where: str) -> None:
    try:
        look_up(spec)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{spec} is gone ({error}) with {versions(distribution)}; lightning_mgpu/{where} relies on it")


@pytest.mark.parametrize("distribution, module, text, where", ASSIGNED, ids=[f"{a[1]}:{a[2]}" for a in ASSIGNED])
def test_private_instance_attribute_is_still_assigned(distribution: str, module: str, text: str, where: str) -> None:
    source = inspect.getsource(importlib.import_module(module))
    assert text in source, f"{module} no longer holds {text!r} with {versions(distribution)}; " \
                           f"lightning_mgpu/{where} relies on it"


@pytest.mark.parametrize("spec, keywords", KEYWORDS, ids=[k[0] for k in KEYWORDS])
def test_private_function_takes_the_keywords_passed(spec: str, keywords: tuple[str, ...]) -> None:
    parameters = inspect.signature(look_up(spec)).parameters
    missing = [k for k in keywords if k not in parameters]
    assert not missing, f"{spec} takes no {missing} with {versions('torch')}; lightning_mgpu passes them"


def private_imports() -> dict[str, str]:
    """``module:name`` (or ``module:`` for a private module) of every private import from another library in the
    package -> the first file that has it."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("lightning_mgpu"):
                for alias in node.names:
                    if alias.name.startswith("_") or "._" in node.module:
                        found.setdefault(f"{node.module}:{alias.name}", str(path.relative_to(PACKAGE)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if "._" in alias.name:
                        found.setdefault(f"{alias.name}:", str(path.relative_to(PACKAGE)))
    return found




# ----------------------------------------------------------------------------------------------------------------------
# Found by parsing the package's source, no list kept by hand: every private name reached through another library's
# module or class, every private attribute read or written on another library's objects, every private method the
# package overrides.

#: The libraries whose objects the package reaches into (their installed sources are searched for the names).
LIBRARIES = ("torch", "lightning", "deepspeed", "transformers")


def _package_trees() -> list[tuple[str, ast.Module]]:
    """(path relative to the package, parsed source) of every module of the package."""
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> ``module`` or ``module:attribute`` of each import from another library in ``tree``."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("lightning_mgpu"):
                    found[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("lightning_mgpu"):
            for alias in node.names:
                found[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return found


def _chain(node: ast.Attribute) -> tuple[Optional[str], list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); (None, ...) when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), parts


def _library_reached() -> dict[str, str]:
    """``module:attribute.path`` (up to its last private part) of every private name the package imports from another
    library or reaches through an imported library module or class -> the first ``file:line`` that does."""
    found = {spec if not spec.endswith(":") else ":".join(spec[:-1].rsplit(".", 1)): where
             for spec, where in private_imports().items()}
    for path, tree in _package_trees():
        aliases = _aliases(tree)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            root, parts = _chain(node)
            private = [i for i, part in enumerate(parts) if _is_private(part)]
            if root in aliases and private:
                target = aliases[root]
                module, _, attribute = target.partition(":")
                path_of = ".".join(([attribute] if attribute else []) + parts[:private[-1] + 1])
                found.setdefault(f"{module}:{path_of}", f"{path}:{node.lineno}")
    return found


def _distribution(module: str) -> str:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
        return "python"
    return importlib.metadata.packages_distributions().get(top, [top])[0]


REACHED = _library_reached()


@pytest.mark.parametrize("spec", sorted(REACHED))
def test_private_name_reached_through_a_library_exists(spec: str) -> None:
    try:
        look_up(spec)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{spec} is gone ({error}) with {versions(_distribution(spec))}; lightning_mgpu/{REACHED[spec]} "
                    "reaches it")


def _own_names(tree: ast.Module) -> set[str]:
    """The names ``tree`` defines itself: module-level and class-level definitions, attributes its classes' methods
    assign on their first argument (``self._x = ...``) and submodules, buffers and parameters it registers by name."""
    own = set()
    for node in tree.body:
        own |= _defined(node)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            own |= _defined(item)
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.args.args:
                me = item.args.args[0].arg
                own |= {n.attr for n in ast.walk(item) if isinstance(n, ast.Attribute)
                        and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == me}
    own |= {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in REGISTERS and n.args and isinstance(n.args[0], ast.Constant)}
    return own


#: torch's calls that give a module an attribute by name (``add_module("_x", child)``: the name is the package's).
REGISTERS = ("add_module", "register_module", "register_buffer", "register_parameter")


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _object_accesses() -> dict[str, str]:
    """Private attribute names the package reads or writes on objects that are not its own (``obj._x``,
    ``getattr(obj, "_x", default)``, ``hasattr``, ``setattr``), that no module of the package defines -> the first
    ``file:line`` (with the call, where a default would hide a missing name)."""
    own = set().union(*(_own_names(tree) for _, tree in _package_trees()))
    found: dict[str, str] = {}
    for path, tree in _package_trees():
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and _chain(node)[0] not in aliases:
                found.setdefault(node.attr, f"{path}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _is_private(node.args[1].value)):
                found.setdefault(node.args[1].value, f"{path}:{node.lineno} ({node.func.id})")
    return {name: where for name, where in found.items() if name not in own}


def _named_in(libraries: tuple[str, ...], names: set[str]) -> dict[str, set[str]]:
    """Each of ``names`` -> the libraries whose installed source mentions it (as a whole word)."""
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    seen: dict[str, set[str]] = {name: set() for name in names}
    for library in libraries:
        for root in importlib.util.find_spec(library).submodule_search_locations:
            for path in Path(root).rglob("*.py"):
                for name in set(pattern.findall(path.read_text(errors="replace"))):
                    seen[name].add(library)
    return seen


def test_private_attributes_of_library_objects_are_still_the_libraries():
    """An attribute the package reads or writes on a torch, Lightning, DeepSpeed or transformers object is still named
    in that library's source: a renamed or removed one (read with a default, it would fail silently) fails here with
    the file and line that uses it and the pinned versions."""
    accesses = _object_accesses()
    assert len(accesses) > 10, accesses  # the search finds what it is meant to (e.g. torch's _opt_called)
    seen = _named_in(LIBRARIES, set(accesses))
    gone = [f".{name} at lightning_mgpu/{where}" for name, where in sorted(accesses.items())
            if not seen[name]]
    assert not gone, (f"named by none of {', '.join(LIBRARIES)} nor by the package: {gone}; with "
                      + "; ".join(versions(library) for library in LIBRARIES))


def _overrides() -> list[tuple[str, str, str, bool]]:
    """(module, class, method, marked @override) of every private method of a package class that is marked
    ``@override`` or that a base class from another library defines."""
    found = []
    for path, tree in _package_trees():
        module = "lightning_mgpu." + path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or not _is_private(item.name):
                    continue
                marked = any(isinstance(d, (ast.Name, ast.Attribute)) and (getattr(d, "id", None) == "override"
                             or getattr(d, "attr", None) == "override") for d in item.decorator_list)
                bases = [b for b in getattr(importlib.import_module(module), cls.name).__mro__[1:]
                         if not b.__module__.startswith("lightning_mgpu") and b is not object]
                if marked or any(item.name in vars(b) for b in bases):
                    found.append((module, cls.name, item.name, marked))
    return found


def test_overridden_private_methods_are_marked_and_still_overridden():
    """A private method the package overrides is marked ``@override``, and a base class from another library still
    defines it: a renamed hook would otherwise leave the package's version uncalled, silently."""
    problems = []
    for module, name, method, marked in _overrides():
        cls = getattr(importlib.import_module(module), name)
        bases = [b for b in cls.__mro__[1:] if not b.__module__.startswith("lightning_mgpu") and b is not object]
        owner = next((b for b in bases if method in vars(b)), None)
        if owner is None:
            top = bases[0].__module__ if bases else "builtins"
            problems.append(f"{module}.{name}.{method} overrides nothing of {[b.__qualname__ for b in bases]} with "
                            f"{versions(_distribution(top))}")
        elif not marked:
            problems.append(f"{module}.{name}.{method} overrides {owner.__module__}.{owner.__qualname__}.{method}: "
                            "mark it @override (typing_extensions), so that this test sees it if the name goes")
    assert len(_overrides()) >= 5 and not problems, problems
