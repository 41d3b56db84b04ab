"""Hugging Face Llama interop, offline: a tiny LlamaForCausalLM built here (random weights, nothing downloaded)
goes through import -> 0 training steps on a parallel layout -> export, and transformers' own forward agrees; tied
embeddings included. One ``mgpu-train model.init_from=hf:PATH`` run starts from transformers' loss and gradient norm,
and its checkpoint feeds ``mgpu-export --dtype`` and the refusal of a trainer state that holds code."""

import csv
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from forked_cli import run_cli
from helpers import datamodule, fit, global_batches
from safetensors.torch import load_file

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.hf.names import from_hf_config, to_hf_name
from lightning_mgpu.hf.weights import load_hf, load_into
from lightning_mgpu.checkpoint.integrity import record_checksums
from lightning_mgpu.checkpoint.universal import (TRAINER_STATE, read_model_weights, read_parameters,
                                                 read_trainer_state)
from lightning_mgpu.cli.export import main as export_main
from lightning_mgpu.models import Llama
from lightning_mgpu.testing import run_distributed


def tiny_hf(directory, tied: bool):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_imported_weights_give_transformers_logits(tmp_path, tied):
    reference = tiny_hf(tmp_path / "hf", tied)
    config, state = load_hf(tmp_path / "hf")
    assert (config.n_heads, config.n_kv_heads, config.tie_embeddings, config.rope_theta) == (4, 2, tied, 500000.0)
    ours = Llama(config)
    load_into(ours, state)
    torch.testing.assert_close(ours(TOKENS), hf_logits(reference, TOKENS), atol=1e-5, rtol=0)


def _round_trip(rank, hf_dir, ckpt_dir, devices, strategy_kwargs):
    config = from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MGPUStrategy(**{"save_consolidated_weights": True, **strategy_kwargs}))
    trainer.fit(LLMModule(config, init_from=f"hf:{hf_dir}"), datamodule(_token_file(hf_dir)))
    trainer.save_checkpoint(str(ckpt_dir))


def _token_file(directory):
    from helpers import make_token_file

    return make_token_file(directory, n_tokens=5000)


#: The plan of the untied tiny model in fp32 under ``--max-shard-size 20KB`` (20000 bytes), worked by hand in our
#: parameter order: embedding 8192 bytes, a norm 128, wq and wo 4096, wk and wv 2048, each MLP weight 8192, head 8192.
#: 8192+128+4096+2048+2048 = 16512 (+4096 for wo > 20000) | wo 4096+128+8192 = 12416 (+8192 for w3 > 20000) |
#: 8192+8192+128 = 16512 (+4096) | 4096+2048+2048+4096+128 = 12416 (+8192 for w1 > 20000) | 8192+8192 (+8192) |
#: 8192+128+8192 = 16512: six shards.
SHARDS_20KB = [["tok_embeddings", "layers.0.attention_norm", "layers.0.attention.wq", "layers.0.attention.wk",
                "layers.0.attention.wv"],
               ["layers.0.attention.wo", "layers.0.ffn_norm", "layers.0.feed_forward.w1"],
               ["layers.0.feed_forward.w3", "layers.0.feed_forward.w2", "layers.1.attention_norm"],
               ["layers.1.attention.wq", "layers.1.attention.wk", "layers.1.attention.wv", "layers.1.attention.wo",
                "layers.1.ffn_norm"],
               ["layers.1.feed_forward.w1", "layers.1.feed_forward.w3"],
               ["layers.1.feed_forward.w2", "norm", "output"]]


def recorded_reads(monkeypatch) -> list:
    """The parameter names of every call the exporter makes to read a universal checkpoint, in order."""
    from lightning_mgpu.cli import export

    calls: list = []

    def recording(path, shapes, *args):
        calls.append(list(shapes))
        return read_parameters(path, shapes, *args)

    monkeypatch.setattr(export, "read_parameters", recording)
    return calls


def index_shards(directory) -> list[list[str]]:
    """The tensor names of each shard of an export (sorted), in file order, from its ``model.safetensors.index.json``;
    each file holds exactly the tensors the index gives it."""
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert sorted(p.name for p in directory.glob("*.safetensors")) == files
    shards = [sorted(k for k, v in weight_map.items() if v == f) for f in files]
    assert [sorted(load_file(str(directory / f))) for f in files] == shards
    return shards


@pytest.mark.parametrize("layout, tied, shard_size",
                         [(dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=3), True, None),
                          (dict(pipeline_parallel_size=2, zero_stage=1), False, "40KB"),
                          (dict(tensor_parallel_size=2, zero_stage=1, save_consolidated_weights=False), False, "20KB")],
                         ids=["tp2_sp_zero3_tied", "pp2_zero1", "tp2_from_universal_checkpoint"])
def test_import_train_zero_steps_export_round_trip(tmp_path, monkeypatch, layout, tied, shard_size):
    """Tied embeddings: one tensor in our model (split over the vocabulary under tp), ``embed_tokens`` alone in the
    export, and transformers ties ``lm_head`` to it again on loading. With ``--max-shard-size``, several shards and
    their index, which transformers loads; from a universal checkpoint, each read asks for one shard's parameters."""
    reference = tiny_hf(tmp_path / "hf", tied=tied)
    run_distributed(_round_trip, 2, tmp_path / "hf", tmp_path / "ckpt", 2, layout)
    reads = recorded_reads(monkeypatch)
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "exported"), "--format", "hf",
                 *(["--max-shard-size", shard_size] if shard_size else [])])
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert exported.config.tie_word_embeddings is tied
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) is tied
    torch.testing.assert_close(hf_logits(exported, TOKENS), hf_logits(reference, TOKENS), atol=1e-5, rtol=0)
    if shard_size is None:
        assert sorted(p.name for p in (tmp_path / "exported").glob("model*")) == ["model.safetensors"]
        return
    shards = index_shards(tmp_path / "exported")
    if shard_size == "40KB":  # 37120 | 37120 | 16512 bytes: each layer's w2 starts the next shard
        assert [len(s) for s in shards] == [9, 9, 3]
        return
    assert shards == [sorted(to_hf_name(f"{name}.weight") for name in shard) for shard in SHARDS_20KB]
    assert reads == [[f"{name}.weight" for name in shard] for shard in SHARDS_20KB]  # one read per shard, in order


def test_mismatched_shapes_are_named(tmp_path):
    tiny_hf(tmp_path / "hf", tied=False)
    _, state = load_hf(tmp_path / "hf")
    other = Llama(from_hf_config({**json.loads((tmp_path / "hf" / "config.json").read_text()),
                                  "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"layers.0.feed_forward.w1.weight: checkpoint \(64, 32\) vs model \(96, 32\)"):
        load_into(other, state)


def test_a_checkpoint_with_extra_or_missing_tensors_is_refused_before_any_slice_is_read(tmp_path):
    """Each rank reads only its slices, so a checkpoint from a deeper model (an extra layer) or a shallower one would
    otherwise load silently on the ranks that never touch the difference: both are named at once when it is opened."""
    from safetensors.torch import save_file

    from lightning_mgpu.hf.weights import HFWeights

    tiny_hf(tmp_path / "hf", tied=False)
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    deeper = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in state.items() if ".layers.1." in k}
    extra = dict(state, **deeper)
    del extra["model.layers.0.mlp.up_proj.weight"]
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older checkpoints hold it: not a weight
    save_file(extra, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError) as refused:
        HFWeights(tmp_path / "hf")
    message = str(refused.value)
    assert "missing model.layers.0.mlp.up_proj.weight" in message
    assert message.count("unexpected model.layers.2.") == 9 and "inv_freq" not in message


# ----------------------------------------------------------------- mgpu-train model.init_from=hf:PATH, then mgpu-export
@pytest.fixture(scope="module")
def cli_run(token_file, tmp_path_factory):
    """One step of ``mgpu-train`` from a tied Hugging Face model, saved on exit. One process: a second one costs
    ~10 s of start-up in a subprocess run, and the parallel layouts load init_from in the round trips above."""
    root = tmp_path_factory.mktemp("cli")
    hf = tiny_hf(root / "hf", tied=True)
    proc = _mgpu_train(root, token_file, root / "run", "trainer.max_steps=1", "checkpoint.save_last=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"hf": hf, "hf_dir": root / "hf", "run": root / "run", "root": root,
            "checkpoint": root / "run" / "checkpoints" / "step-00000001"}


def _mgpu_train(root, token_file, run_dir, *overrides):
    """``mgpu-train`` on one process from the tiny Hugging Face model in ``root / "hf"``."""
    mgpu_train = Path(sys.executable).parent / "mgpu-train"
    return run_cli([str(mgpu_train), "trainer.devices=1", f"model.init_from=hf:{root / 'hf'}", "data=tokens",
                    f"data.path={token_file}", "data.seq_len=16", "data.global_batch_size=8",
                    "data.micro_batch_size=2", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
                    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "seed=7",
                    "sample.prompt=0", "sample.max_new_tokens=1", f"hydra.run.dir={run_dir}", *overrides],
                   cwd=root, timeout=240)


def test_cli_init_from_hf_starts_from_its_weights(token_file, cli_run):
    """The first step's loss and gradient norm (before clipping) are transformers' own on the same global batch."""
    batch = next(global_batches(token_file, 1, global_batch=8, seq_len=16, seed=7))
    model = cli_run["hf"]
    model.zero_grad()
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    rows = [r for r in csv.DictReader((cli_run["run"] / "metrics.csv").open()) if r.get("train/loss")]
    assert len(rows) == 1
    assert abs(float(rows[0]["train/loss"]) - loss.item()) < 1e-5, (rows[0]["train/loss"], loss.item())
    assert abs(float(rows[0]["train/grad_norm"]) - grad_norm.item()) < 1e-5, (rows[0]["train/grad_norm"], grad_norm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_dtype_rounds_the_fp32_weights(cli_run, tmp_path, dtype):
    export_main([str(cli_run["checkpoint"]), str(tmp_path / "out"), "--dtype", dtype])
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    config, fp32 = read_model_weights(cli_run["checkpoint"])
    assert config["tie_embeddings"] and "output.weight" not in fp32  # tied: one tensor, written once
    assert sorted(exported) == sorted(to_hf_name(k) for k in fp32)
    for name, value in fp32.items():
        assert value.dtype == torch.float32
        got = exported[to_hf_name(name)]
        assert got.dtype == getattr(torch, dtype), (name, got.dtype)
        assert torch.equal(got, value.to(got.dtype)), name  # round to nearest, not truncated or rescaled
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


class _MakesADirectory:
    """Unpickling this object calls ``os.mkdir(path)``: the stand-in for code hidden in a checkpoint."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _resume(rank, token_file, checkpoint, config):
    return fit(rank, token_file, 1, max_steps=2, ckpt_path=str(checkpoint), model=config)


def test_a_trainer_state_holding_code_is_refused(cli_run, token_file, tmp_path, monkeypatch, capfd):
    """The universal loader and mgpu-export refuse a ``trainer_state.pt`` that holds any object other than containers
    of tensors and numbers, before constructing it. torch's own default (weights_only since 2.6) is switched off
    here, as older torch or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` would, so only the loader's explicit
    ``weights_only=True`` protects it."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(cli_run["checkpoint"], checkpoint)
    config = from_hf_config(json.loads((cli_run["hf_dir"] / "config.json").read_text()))
    marker = tmp_path / "code_ran"
    torch.save({**read_trainer_state(checkpoint), "extra": _MakesADirectory(marker)}, checkpoint / TRAINER_STATE)
    record_checksums(checkpoint)  # as an attacker would: only the loader's own restriction protects
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    named = re.escape(str(checkpoint / TRAINER_STATE)) + r" names (os|posix)\.mkdir"
    with pytest.raises(SystemExit) as exit_info:  # a refusal: exit status 2 and the file and type on stderr
        export_main([str(checkpoint), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and re.search(named, capfd.readouterr().err)
    with pytest.raises(Exception, match=named):
        run_distributed(_resume, 1, token_file, checkpoint, config)
    assert not marker.exists()


def test_cli_resume_auto_refuses_metadata_holding_code(cli_run, token_file, tmp_path):
    """``mgpu-train checkpoint.resume=auto`` over a checkpoint whose ``.metadata`` pickle runs a command and then
    returns the real metadata (checksums re-recorded, as an attacker would): refused, naming the file and the type,
    and the command never runs."""
    from test_checkpoint_safety import RunsCodeThenReturns

    from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata

    checkpoint = tmp_path / "ckpts" / "step-00000001"
    shutil.copytree(cli_run["checkpoint"], checkpoint)
    marker = tmp_path / "code_ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCodeThenReturns(marker, read_dcp_metadata(checkpoint))))
    record_checksums(checkpoint)
    proc = _mgpu_train(cli_run["root"], token_file, tmp_path / "run", "trainer.max_steps=2",
                       f"checkpoint.dir={tmp_path / 'ckpts'}", "checkpoint.resume=auto")
    assert proc.returncode != 0
    assert f"{checkpoint / '.metadata'} names _operator.getitem" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()
