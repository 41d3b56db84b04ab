"""The sequence-length rule's fix is the model source's (``cli.model_source``): with ``model=hf`` or ``model.init_from``
the shape comes from the directory's config.json, so the fix is a shorter ``data.seq_len``, never the package model's
``model.max_seq_len`` (which ``model=hf`` refuses and ``model.init_from`` does not read): a user who follows the message
does not get the same message again."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from cli_helpers import TINY_MODEL, cli_args, composed
from helpers import make_token_file

from lightning_mgpu.cli.spec import run_spec


def problems(*overrides: str) -> str:
    """The configuration error's text of a run with ``overrides`` (empty when the run is accepted)."""
    try:
        run_spec(composed(*overrides), launching=False)
    except Exception as error:  # the CLI's ConfigError, raised before anything starts
        return str(error)
    return ""


@pytest.mark.parametrize("source", ["model=hf", "model.init_from"])
def test_the_sequence_length_fix_is_one_the_source_takes(source, tmp_path: Path):
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8)).save_pretrained(directory)
    run = [a for a in cli_args(make_token_file(tmp_path), 2) if a not in TINY_MODEL and not a.startswith("model.")]
    given = ["model=hf", f"model.path={directory}"] if source == "model=hf" else [f"model.init_from=hf:{directory}"]
    first = problems(*given, *run)  # data.seq_len=16 against max_position_embeddings=8
    assert "data.seq_len=16 exceeds the model's max_seq_len=8; lower data.seq_len to at most 8" in first, first
    assert "model.max_seq_len>=" not in first, first
    assert problems(*given, *[a for a in run if not a.startswith("data.seq_len=")], "data.seq_len=8") == ""
    if source == "model=hf":  # the package model's key is refused, not silently ignored
        assert "model.max_seq_len=16: model=hf takes its shape from" in problems(*given, *run, "model.max_seq_len=16")
