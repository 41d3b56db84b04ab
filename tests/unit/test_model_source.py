"""The run's model source is asked in one place (``lightning_mgpu.cli.model_source``): no other module of the command
line compares ``model.name`` with the transformers source's name, and each source answers the questions the rules and
builders ask with its own keys and fixes (expected texts written here from the keys a user sets)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_mgpu.cli.config import TrainConfig
from lightning_mgpu.cli.model_source import TRANSFORMERS, OwnModel, TransformersDirectory, model_source
from lightning_mgpu.problems import Problem

CLI = Path(__file__).resolve().parents[2] / "lightning_mgpu" / "cli"


def _names_the_source(node: ast.AST) -> bool:
    """Whether ``node`` is the transformers source's name (the string, or the constant that holds it), or holds it (a
    tuple, list or set of names)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_the_source(item) for item in node.elts)
    return (isinstance(node, ast.Constant) and node.value == TRANSFORMERS) or \
        (isinstance(node, ast.Name) and node.id == "TRANSFORMERS")


def _compares_the_source_name(tree: ast.AST) -> list[int]:
    """Lines that branch on the kind of source: a comparison (``==``, ``in``) with the transformers source's name, a
    ``case`` of it, or an ``isinstance`` of a source class."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_the_source(side) for side in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_the_source(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and any(
                isinstance(arg, ast.Name) and arg.id in ("OwnModel", "TransformersDirectory") for arg in ast.walk(node)):
            lines.append(node.lineno)
    return lines


def test_no_module_of_the_command_line_but_the_source_branches_on_model_hf():
    found = {path.name: _compares_the_source_name(ast.parse(path.read_text())) for path in sorted(CLI.glob("*.py"))
             if path.name != "model_source.py"}
    assert {name: lines for name, lines in found.items() if lines} == {}
    # the check sees such a branch however it is written
    for branch in ('if cfg.model.name == "hf":\n    pass\n', 'if m.name != TRANSFORMERS:\n    pass\n',
                   'if name in ("tiny", "hf"):\n    pass\n', 'if isinstance(s, TransformersDirectory):\n    pass\n',
                   'match name:\n    case "hf":\n        pass\n'):
        assert _compares_the_source_name(ast.parse(branch)), branch


def _model(**overrides) -> OmegaConf:
    cfg = OmegaConf.structured(TrainConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, f"model.{key}", value, merge=False)
    return cfg


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def test_the_source_is_chosen_by_model_name(directory):
    assert isinstance(model_source(_model(name="hf", path=str(directory))), TransformersDirectory)
    assert isinstance(model_source(_model(name="tiny")), OwnModel)


def test_a_directory_lists_every_setting_of_the_packages_own_model_at_once(directory):
    problems = model_source(_model(name="hf", path=str(directory), compile=True, dim=64, n_layers=2)).problems()
    assert len(problems) == 3
    assert problems[0].startswith("model.compile=True is a setting of the package's own model")
    assert problems[1] == f"model.dim=64: model=hf takes its shape from {directory}/config.json; leave model.dim unset"
    assert problems[2].startswith("model.n_layers=2: model=hf")


def test_a_directory_without_config_json_is_named_with_its_key(tmp_path):
    problems = model_source(_model(name="hf", path=str(tmp_path / "nowhere"))).problems()
    assert problems == [f"model.path={str(tmp_path / 'nowhere')!r} is not a Hugging Face model directory (no "
                        "config.json); give model.path=DIR of a directory with config.json and *.safetensors"]


def test_each_source_states_the_vocabulary_fix_with_its_own_key(directory):
    own = model_source(_model(name="tiny")).vocabulary_problem(256, 300, "the data")
    hf = model_source(_model(name="hf", path=str(directory))).vocabulary_problem(256, 300, "the data")
    assert own.endswith("set model.vocab_size>=300")
    assert hf.startswith(f"the vocab_size=256 of {directory}/config.json is smaller than the data")
    assert "model.vocab_size" not in hf  # a directory's size is not a key the user sets


def test_a_tied_head_is_restated_as_the_directory_states_it_and_only_there(directory):
    problem = Problem("tie_embeddings", True, "a tied head cannot be cut from its embedding", "untie it")
    restated = model_source(_model(name="hf", path=str(directory))).restated(problem)
    assert restated.field == f"{directory}/config.json: tie_word_embeddings"
    assert restated.fix == "this model's head is its embedding; set pipeline_parallel_size=1"
    assert model_source(_model(name="tiny")).restated(problem) is problem


def test_a_directory_needs_its_weights_on_this_machine_and_the_own_model_does_not(directory):
    hf = model_source(_model(name="hf", path=str(directory)))
    assert len(hf.machine_problems()) == 1 and "has no *.safetensors weights" in hf.machine_problems()[0]
    (directory / "model.safetensors").write_bytes(b"")
    assert hf.machine_problems() == []
    assert model_source(_model(name="tiny")).machine_problems() == []


def test_the_closing_sample_of_a_directory_needs_whole_sequences_and_a_tokenizer(directory):
    hf, own = model_source(_model(name="hf", path=str(directory))), model_source(_model(name="tiny"))
    assert "sequence-parallel shards" in hf.no_sample_reason(sequence_parallel=True, has_tokenizer=True)
    assert "has no tokenizer.json" in hf.no_sample_reason(sequence_parallel=False, has_tokenizer=False)
    assert hf.no_sample_reason(sequence_parallel=False, has_tokenizer=True) is None
    assert own.no_sample_reason(sequence_parallel=True, has_tokenizer=False) is None
