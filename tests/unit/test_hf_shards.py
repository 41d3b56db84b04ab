"""Safetensors shards as ``transformers`` lays them out: the plan (consecutive groups under a byte limit, an oversized
tensor alone), the writer (one shard read at a time, the index, one file without an index, stale shards removed) and
``mgpu-export --max-shard-size``'s sizes and refusals. In this process, on tensors of a few bytes."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_mgpu.hf.shards import (DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, plan_shards, shard_file_names,
                                      write_shards)
from lightning_mgpu.cli import export


def test_tensors_are_grouped_in_order_until_the_next_would_pass_the_limit():
    # 4 | 4+3 > 6: cut | 3+2 = 5, 5+6 > 6: cut | 6 = 6 fits exactly, 6+1 > 6: cut | 1
    sizes = [("a", 4), ("b", 3), ("c", 2), ("d", 6), ("e", 1)]
    assert plan_shards(sizes, 6) == [["a"], ["b", "c"], ["d"], ["e"]]
    assert plan_shards([("a", 5), ("b", 5)], 10) == [["a", "b"]]
    assert plan_shards([("a", 5), ("b", 5)], 9) == [["a"], ["b"]]


def test_a_tensor_over_the_limit_is_alone_in_its_shard():
    sizes = [("a", 1), ("big", 10), ("b", 1), ("c", 1)]
    assert plan_shards(sizes, 5) == [["a"], ["big"], ["b", "c"]]
    assert plan_shards([("big", 10)], 5) == [["big"]]


def test_the_default_limit_is_transformers_5GB_and_a_limit_under_a_byte_is_refused():
    assert DEFAULT_MAX_SHARD_BYTES == 5 * 10**9
    assert plan_shards([("a", 4 * 10**9), ("b", 10**9), ("c", 1)]) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match="max_shard_bytes=0 is not positive.*give e.g. 5000000000"):
        plan_shards([("a", 1)], 0)


def test_files_are_named_as_transformers_names_them():
    assert shard_file_names(1) == [SINGLE_FILE]
    assert shard_file_names(3) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                   "model-00003-of-00003.safetensors"]


TENSORS = {"a": torch.arange(4.0), "b": torch.ones(2, 3), "c": torch.full((2,), 7.0), "d": torch.zeros(5)}


def _recording_reader(asked: list):
    def read(names):
        asked.append(list(names))
        return {name: TENSORS[name].clone() for name in names}
    return read


def test_each_shard_is_read_alone_then_written_with_the_index(tmp_path):
    plan = [["a", "b"], ["c"], ["d"]]
    asked: list = []
    written = write_shards(tmp_path, plan, _recording_reader(asked))
    assert asked == plan
    files = shard_file_names(3)
    assert written == [tmp_path / f for f in files] + [tmp_path / INDEX_FILE]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index == {"metadata": {"total_size": (4 + 6 + 2 + 5) * 4},
                     "weight_map": {"a": files[0], "b": files[0], "c": files[1], "d": files[2]}}
    for names, file in zip(plan, files):
        saved = load_file(str(tmp_path / file))
        assert sorted(saved) == names and all(torch.equal(saved[n], TENSORS[n]) for n in names)
        with safe_open(str(tmp_path / file), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}  # transformers refuses a shard without it


def test_one_shard_is_one_model_safetensors_and_stale_shards_go(tmp_path):
    """An earlier export of three shards into the same directory: none of its files is left to be read beside the
    new one (a loader reads every ``*.safetensors`` file there)."""
    write_shards(tmp_path, [["a"], ["b"], ["c", "d"]], _recording_reader([]))
    (tmp_path / "notes.txt").write_text("kept")
    written = write_shards(tmp_path, [["a", "b", "c", "d"]], _recording_reader([]))
    assert written == [tmp_path / SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    assert sorted(load_file(str(tmp_path / SINGLE_FILE))) == ["a", "b", "c", "d"]


def test_a_reader_that_returns_other_tensors_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=r"shard model-00001-of-00002.safetensors: .*missing \['b'\], extra \['d'\]"):
        write_shards(tmp_path, [["a", "b"], ["c"]], lambda names: {"a": TENSORS["a"], "d": TENSORS["d"]})


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("200KB", 200_000),
                                        ("123", 123), ("123B", 123), ("5 gb", 5 * 10**9), ("1.5GiB", 3 * 2**29),
                                        ("2MiB", 2 * 2**20), ("0.5KB", 500)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
    assert export.parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "-1", "0", "0.1B", "", "GB", "5GB6", "1e9"])
def test_what_is_not_a_size_is_not_read_as_one(text):
    assert export.parse_size(text) is None


def test_a_bad_shard_size_is_refused_with_the_others_naming_value_rule_and_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        export.main([str(tmp_path / "nothing"), str(tmp_path / "out"), "--max-shard-size", "lots"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "is not a directory" in err  # every problem at once
    assert "--max-shard-size 'lots' is not a size of at least one byte" in err
    assert "KB, MB, GB, TB (powers of 1000)" in err and "e.g. --max-shard-size 5GB" in err


def test_each_expert_of_a_stacked_weight_is_a_tensor_of_its_own_shape_in_parameter_order():
    """What the plan is made of: a Mixtral layer's stacked ``w2`` ``[4, 24, 32]`` is four ``[32, 24]`` tensors (each
    the transpose of its expert), in expert order, after the layer's router; a tied head is no tensor."""
    from lightning_mgpu.hf.export import hf_sources
    from lightning_mgpu.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=24, num_experts=4,
                      experts_per_token=2, tie_embeddings=True)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Llama(cfg).named_parameters()}
    sources = hf_sources(shapes, cfg)
    keys = list(sources)
    w2 = [k for k in keys if k.endswith(".w2.weight")]
    assert w2 == [f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
    assert {sources[k] for k in w2} == {("layers.0.feed_forward.experts.w2", (32, 24))}
    assert keys.index("model.layers.0.block_sparse_moe.gate.weight") < keys.index(w2[0])
    # embedding, 2 norms, q k v o, router, 3 x 4 experts, final norm
    assert "lm_head.weight" not in sources and len(keys) == 1 + 2 + 4 + 1 + 3 * 4 + 1
    del shapes["norm.weight"]
    with pytest.raises(ValueError, match=r"the weights lack 1 parameters .*\(e.g. norm.weight\)"):
        hf_sources(shapes, cfg)


def test_the_checkpoint_itself_is_refused_as_out(tmp_path):
    """Its consolidated ``model.safetensors`` is a file an export would delete as a stale shard."""
    problems = export.export_problems(tmp_path, tmp_path)
    assert any(f"out {str(tmp_path)!r} is the checkpoint itself" in p and "give another directory" in p
               for p in problems), problems
