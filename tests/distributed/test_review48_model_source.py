"""Review 48: the sequence-length rule's fix is the package's own model's key whatever the model source
(``data_rules.seq_len_problems`` is not asked of ``cli.model_source``): with ``model=hf`` or ``model.init_from`` the
shape comes from the directory's config.json, so ``model.max_seq_len`` is ignored (not refused either), and a user who
follows the message gets the same message again. Marked xfail until fixed."""

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


@pytest.mark.xfail(strict=True, reason="Review 48: with model=hf or model.init_from the seq_len rule says 'set "
                   "model.max_seq_len>=N', which that source ignores: the same error comes back")
@pytest.mark.parametrize("source", ["model=hf", "model.init_from"])
def test_the_sequence_length_fix_is_one_the_source_takes(source, tmp_path: Path):
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8)).save_pretrained(directory)
    run = [a for a in cli_args(make_token_file(tmp_path), 2) if a not in TINY_MODEL and not a.startswith("model.")]
    given = ["model=hf", f"model.path={directory}"] if source == "model=hf" else [f"model.init_from=hf:{directory}"]
    first = problems(*given, *run)  # data.seq_len=16 against max_position_embeddings=8
    assert "data.seq_len=16 exceeds the model's max_seq_len=8" in first, first
    if "set model.max_seq_len>=16" in first:  # the fix it names must be one this source takes
        again = problems(*given, *run, "model.max_seq_len=16")
        assert "data.seq_len=16 exceeds" not in again, again
