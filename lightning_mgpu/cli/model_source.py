"""Where a run's model comes from, asked in one place: the package's own Llama (:class:`OwnModel`: a named shape,
or the shape and weights of a transformers Llama directory through ``model.init_from``) or a ``transformers`` model
trained as it is (:class:`TransformersDirectory`: ``model=hf``, ``model.path``).

Every part of ``mgpu-train`` whose rule or builder depends on the source -- the model group's rules, the planning
shape, the tokenizer beside the weights, the weights this machine must hold, the adapters' targets, the layout's
wording, the module built, the closing sample -- asks :func:`model_source` rather than comparing ``model.name``
itself; ``tests/unit/test_model_source.py`` keeps it so. A third source (another directory format, a model hub
cache) is one more class here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig

from lightning_mgpu.cli.rule_base import _positive
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.models import LLAMA_SHAPES, LlamaConfig
from lightning_mgpu.models.llama_config import activation_checkpointing_problems
from lightning_mgpu.problems import AnyProblem, Problem

if TYPE_CHECKING:
    import lightning as L

#: ``model.name`` of a ``transformers`` directory trained as it is (``model=hf``).
TRANSFORMERS = "hf"
#: ``model.<key>`` sizes of the package's own model, which a transformers directory's config.json states instead.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len")


@dataclass(frozen=True)
class OwnModel:
    """The package's own Llama: ``model.name``'s shape with ``model.*`` overrides, or ``model.init_from``'s."""

    model: DictConfig  #: the run's ``model`` group

    def problems(self) -> list[str]:
        """The model group's own rules (a shape it cannot build is the shape's error, asked when it is built)."""
        m = self.model
        if m.init_from and not (self._init_directory() / "config.json").is_file():
            return [f"model.init_from={m.init_from!r} is not a Hugging Face Llama directory (no config.json); "
                    "give hf:PATH of a directory with config.json and *.safetensors"]
        if m.name not in LLAMA_SHAPES:
            return [f"model.name={m.name!r} is unknown; choose one of {', '.join(LLAMA_SHAPES)} (or model=NAME)"]
        out: list[str] = []
        for key in SHAPE_KEYS:
            if m[key] is not None:
                out += _positive(f"model.{key}", m[key])
        out += activation_checkpointing_problems(m.activation_checkpointing, "model.activation_checkpointing")
        if m.compile:
            from lightning_mgpu.parallel.compile import compile_backend_problems

            out += compile_backend_problems(m.compile_backend, "model.compile_backend")
        return out

    def shape(self) -> LlamaConfig:
        """The model's config before adapters and the data's end-of-document id: ``model.init_from``'s shape
        (whatever ``model.name`` says), else the named shape with its overrides."""
        m = self.model
        options = dict(activation_checkpointing=m.activation_checkpointing, compile=m.compile,
                       compile_backend=m.compile_backend)
        if m.init_from:
            from lightning_mgpu.hf.names import from_hf_config

            hf = json.loads((self._init_directory() / "config.json").read_text())
            return dataclasses.replace(from_hf_config(hf), **options)
        overrides = {k: m[k] for k in model_overrides() if m[k] is not None}
        return LlamaConfig.from_name(m.name, **options, **overrides)

    def weights_directory(self) -> Optional[tuple[str, Path]]:
        """(the key that names it, the directory of the weights the run starts from), if any."""
        if not self.model.init_from:
            return None
        return f"model.init_from={self.model.init_from!r}", self._init_directory()

    def machine_problems(self) -> list[str]:
        """Nothing: ``model.init_from``'s weights are read, and their absence named, when the model is built."""
        return []

    def adapter_target_problems(self, settings: dict, model: Optional[LlamaConfig]) -> list[str]:
        """Whether PEFT finds ``settings``' targets in the package's Llama of ``model`` (none when the model itself is
        wrong, which its own rules name)."""
        return [] if model is None else list(_own_target_problems(json.dumps(settings, sort_keys=True), model))

    def restated(self, problem: AnyProblem) -> AnyProblem:
        """A layout problem as this source's user sets it: the package's own keys are the user's."""
        return problem

    def layout_problems(self, layout: ParallelLayout) -> list[Problem]:
        """Nothing beyond the layout's rules over the model's shape, which know the package's model whole."""
        return []

    def vocabulary_problem(self, vocab_size: int, size: int, what: str) -> str:
        """The data's ids up to ``size - 1`` do not fit the model's ``vocab_size``: what to change."""
        if self.model.init_from:
            return (f"the vocab_size={vocab_size} of model.init_from={self.model.init_from!r} (its config.json) is "
                    f"smaller than {what}: ids up to {size - 1} have no embedding row; use the tokenizer that came "
                    "with the checkpoint (data.tokenizer, or the tokenizer.json beside its weights)")
        return (f"model.vocab_size={vocab_size} is smaller than {what}: ids up to {size - 1} have no embedding row; "
                f"set model.vocab_size>={size}")

    def sequence_fix(self, seq_len: int, max_seq_len: int) -> str:
        """What to change when ``data.seq_len`` exceeds the model's ``max_seq_len``."""
        if self.model.init_from:
            return (f"lower data.seq_len to at most {max_seq_len}: model.init_from={self.model.init_from!r} takes its "
                    "max_position_embeddings from its config.json (model.max_seq_len does not change it)")
        return f"lower data.seq_len or set model.max_seq_len>={seq_len}"

    def no_sample_reason(self, sequence_parallel: bool, has_tokenizer: bool) -> Optional[str]:
        """Why this source cannot write the closing sample beyond what every source needs: the package's model
        generates under sequence parallelism and in bytes."""
        return None

    def build_module(self, spec: Any, common: dict[str, Any]) -> L.LightningModule:
        """``LLMModule`` of the resolved run ``spec`` with the optimizer settings ``common``."""
        from lightning_mgpu.module import LLMModule

        cfg = spec.config
        return LLMModule(plain_model(spec.model), lr_scaling=cfg.optim.lr_scaling,
                         reference_batch_size=cfg.optim.reference_batch_size,
                         global_batch_size=cfg.data.global_batch_size, init_seed=self.model.init_seed,
                         init_from=self.model.init_from, **common)

    def _init_directory(self) -> Path:
        from lightning_mgpu.hf.names import hf_path

        return hf_path(self.model.init_from)


@dataclass(frozen=True)
class TransformersDirectory:
    """A ``transformers`` model trained as it is: the directory ``model.path`` (config.json, *.safetensors)."""

    model: DictConfig  #: the run's ``model`` group

    def problems(self) -> list[str]:
        """A directory with config.json; the package model's own settings (compilation, imported weights, sizes)
        left unset, since the directory states them (recomputation it takes: its decoder layers are the blocks)."""
        m = self.model
        if not m.path or not self._config_file().is_file():
            return [f"model.path={m.path!r} is not a Hugging Face model directory (no config.json); give "
                    "model.path=DIR of a directory with config.json and *.safetensors"]
        out = [f"model.{key}={m[key]!r} is a setting of the package's own model; model=hf trains the transformers "
               f"model as it is: leave model.{key} unset" for key, unset in (("compile", False), ("init_from", None))
               if m[key] != unset]
        out += activation_checkpointing_problems(m.activation_checkpointing, "model.activation_checkpointing")
        return out + [f"model.{key}={m[key]!r}: model=hf takes its shape from {m.path}/config.json; leave "
                      f"model.{key} unset" for key in SHAPE_KEYS if m[key] is not None]

    def shape(self) -> LlamaConfig:
        """The sizes of its config.json as the planner counts them (``HFCausalLM`` applies recomputation itself)."""
        from lightning_mgpu.hf.names import planning_shape

        shape = planning_shape(json.loads(self._config_file().read_text()))
        return dataclasses.replace(shape, activation_checkpointing=self.model.activation_checkpointing)

    def weights_directory(self) -> Optional[tuple[str, Path]]:
        """(the key that names it, ``model.path``), when set."""
        return None if not self.model.get("path") else (f"model.path={self.model.path!r}", Path(self.model.path))

    def machine_problems(self) -> list[str]:
        """The weights in ``model.path`` must be on this machine (a dry run, which asks nothing of the machine, lays
        out config.json alone; which tensors the model needs is checked when it is built)."""
        m = self.model
        if not m.path or not self._config_file().is_file():
            return []  # no directory at all is the model group's own problem (problems())
        if any(Path(m.path).glob("*.safetensors")):
            return []
        return [f"model.path={m.path!r} has no *.safetensors weights (pickled *.bin files are not read): save the "
                "model there with save_pretrained(DIR) (safetensors is its default), or add dry_run=true to lay out "
                "its config.json alone"]

    def adapter_target_problems(self, settings: dict, model: Optional[LlamaConfig]) -> list[str]:
        """Whether PEFT finds ``settings``' targets in the directory's model, built on meta."""
        config = self._config_file()
        stamp = config.stat().st_mtime_ns if config.is_file() else None
        return list(_directory_target_problems(json.dumps(settings, sort_keys=True), str(self.model.path), stamp))

    def restated(self, problem: AnyProblem) -> AnyProblem:
        """A tied head, or the model's load-balancing loss, named as the directory states it (untying is no fix here:
        its files hold no head of their own)."""
        if isinstance(problem, Problem) and problem.field == "tie_embeddings":
            return dataclasses.replace(problem, field=f"{self.model.path}/config.json: tie_word_embeddings",
                                       fix="this model's head is its embedding; set pipeline_parallel_size=1")
        if isinstance(problem, Problem) and problem.field == "output_router_logits":
            return dataclasses.replace(problem, field=f"{self.model.path}/config.json: output_router_logits")
        return problem

    def layout_problems(self, layout: ParallelLayout) -> list[Problem]:
        """What the directory's model forbids of a valid layout that its planning shape cannot tell, asked of its
        structure built on the meta device (once per directory): attention sinks under context parallelism, a
        load-balancing loss formed otherwise than transformers' MoE families form it under split tokens or layers. The
        same rules refuse at set-up."""
        if layout.size("cp") == 1 and layout.size("pp") == 1 and not layout.sequence_parallel:
            return []
        from lightning_mgpu.hf.context import attention_sink_problems
        from lightning_mgpu.hf.router_loss import router_loss_problems

        config = self._config_file()
        found = _meta_model(str(self.model.path), config.stat().st_mtime_ns if config.is_file() else None)
        return attention_sink_problems(found, layout.size("cp")) + router_loss_problems(found, layout)

    def vocabulary_problem(self, vocab_size: int, size: int, what: str) -> str:
        return (f"the vocab_size={vocab_size} of {self.model.path}/config.json is smaller than {what}: ids up to "
                f"{size - 1} have no embedding row; use the tokenizer that came with the model (data.tokenizer, or "
                "the tokenizer.json beside its weights)")

    def sequence_fix(self, seq_len: int, max_seq_len: int) -> str:
        return (f"lower data.seq_len to at most {max_seq_len}: model=hf takes max_position_embeddings from "
                f"{self.model.path}/config.json")

    def no_sample_reason(self, sequence_parallel: bool, has_tokenizer: bool) -> Optional[str]:
        """A transformers model generates from whole sequences, in its own tokens."""
        if sequence_parallel:
            return ("generation needs the whole model and whole sequences on each rank, and this run splits them into "
                    "sequence-parallel shards (a transformers model's sample needs whole sequences)")
        if not has_tokenizer:
            return (f"{self.model.path} has no tokenizer.json and data.tokenizer is not set, so the prompt cannot be "
                    "written in this model's tokens")
        return None

    def build_module(self, spec: Any, common: dict[str, Any]) -> L.LightningModule:
        """``HFCausalLM`` of the directory, with the run's adapters and, for conversations, the end-of-document id."""
        from lightning_mgpu.hf.module import HFCausalLM

        cfg = spec.config
        eod = spec.model.eod_token_id if cfg.data.source == "sft" else None
        return HFCausalLM(str(Path(self.model.path).resolve()), activation_checkpointing=self.model.activation_checkpointing,
                          seed=cfg.adapters.seed, eod_token_id=eod, **common)

    def _config_file(self) -> Path:
        return Path(str(self.model.path)) / "config.json"


ModelSource = OwnModel | TransformersDirectory


def model_source(cfg: DictConfig) -> ModelSource:
    """The source of ``cfg``'s model: the one place that reads which kind ``model.name`` names."""
    return TransformersDirectory(cfg.model) if cfg.model.name == TRANSFORMERS else OwnModel(cfg.model)


def model_overrides() -> tuple[str, ...]:
    """``model.<key>`` overrides of a named shape: every ``ModelConfig`` field that is a ``LlamaConfig`` field, by the
    same name (the options applied from outside, recomputation and compilation, are passed apart)."""
    from lightning_mgpu.cli.config import ModelConfig

    return tuple(name for name in ModelConfig.__dataclass_fields__ if name in LlamaConfig.__dataclass_fields__
                 and name not in ("activation_checkpointing", "compile", "compile_backend"))


def plain_model(model: LlamaConfig) -> LlamaConfig:
    """The package's own :class:`LlamaConfig` of a resolved model, without what only the planner reads."""
    own = {f.name for f in dataclasses.fields(LlamaConfig)}
    if type(model) is LlamaConfig:
        return model
    return LlamaConfig(**{k: v for k, v in model.to_dict().items() if k in own})


@functools.lru_cache(maxsize=4)
def _meta_model(path: str, stamp: Optional[int]) -> Any:
    """The directory's causal LM as :func:`~lightning_mgpu.hf.model.find_hf_model` finds it, built on the meta device,
    remembered per directory and config.json's modification time (1.7 s for a 70B directory; ``mgpu-plan`` asks it
    for every layout)."""
    from lightning_mgpu.hf.model import find_hf_model
    from lightning_mgpu.hf.module import load_causal_lm

    return find_hf_model(load_causal_lm(path, on_meta=True))


@functools.lru_cache(maxsize=16)
def _directory_target_problems(settings: str, path: str, stamp: Optional[int]) -> tuple[str, ...]:
    """``lora.target_problems``, remembered per settings and model directory (and its config.json's modification
    time): PEFT wraps the whole model on meta to find the targets, 1.7 s for a 70B directory, and ``mgpu-plan``'s
    commands and the checks of one run ask it again for every layout."""
    from lightning_mgpu.hf import lora
    from lightning_mgpu.hf.module import load_causal_lm

    return tuple(lora.target_problems(json.loads(settings), load_causal_lm(path, on_meta=True), path))


@functools.lru_cache(maxsize=16)
def _own_target_problems(settings: str, config: LlamaConfig) -> tuple[str, ...]:
    """``lora.target_problems`` over the package's own Llama of ``config``, built on the meta device, with
    ``all-linear`` as :class:`~lightning_mgpu.hf.lora.ModelAdapters` reads it."""
    import torch

    from lightning_mgpu.hf import lora
    from lightning_mgpu.models.llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    return tuple(lora.target_problems(json.loads(settings), model, "the model", own=True))
