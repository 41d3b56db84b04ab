"""Every private name of another library that lightning_mgpu relies on, looked up here against the installed versions:
an upgrade that renames or removes one fails in this one place, naming the name, where it is used, and the versions
pinned in pyproject.toml, instead of deep inside a multi-process run (or, for a ``getattr`` with a default, silently).

Names a class sets on its instances (``self._x = ...``) cannot be looked up without building one: for those the
library's source must still assign them. Update this list when the package starts or stops relying on a name."""

import ast
import importlib
import importlib.metadata
import inspect
import sys
import tomllib
from pathlib import Path
from typing import Any

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


def test_every_private_import_is_listed():
    """A new import of another library's private name is listed above, so that an upgrade is checked for it."""
    listed = [spec for _, spec, _ in ATTRIBUTES]
    missing = {name: where for name, where in private_imports().items()
               if not any(spec == name or spec.startswith(name if name.endswith(":") else name + ".")
                          for spec in listed)}
    assert not missing, f"list these in ATTRIBUTES: {missing}"
