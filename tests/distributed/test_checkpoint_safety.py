"""Checkpoints are data, never code, and a damaged one is detected.

One 2-rank run writes universal checkpoints at steps 2, 4 and 6 and one more run a DeepSpeed-format checkpoint. Each
attack below is first shown to work on plain unpickling (the marker directory appears), then refused by the loader
with the file and the type named, the marker absent. Checksums are re-recorded after each crafted change, as an
attacker would, so that only the loader's restricted reading stands between the file and its code.
"""

import json
import logging
import operator
import os
import pickle
import re
import shutil
import warnings

import lightning as L
import pytest
import torch
from helpers import GLOBAL_BATCH, OPTIM, TINY, datamodule, fit

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.callbacks import PeriodicCheckpoint
from lightning_mgpu.checkpoint.formats import format_of
from lightning_mgpu.hf.names import to_hf_config
from lightning_mgpu.hf.weights import load_hf
from lightning_mgpu.checkpoint.integrity import CHECKSUMS, checksum_problems, record_checksums
from lightning_mgpu.checkpoint.safe_reader import UnsafeCheckpointError, read_dcp_metadata
from lightning_mgpu.cli.export import main as export_main
from lightning_mgpu.testing import run_distributed

STEPS = 6


class RunsCode:
    """Unpickling it makes the directory ``path``: the sign that a loader ran code from a file."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path, 0o777, True)


class RunsCodeThenReturns:
    """Unpickles to ``value`` after running :class:`RunsCode`: the attack that leaves no trace in the loaded data."""

    def __init__(self, marker, value) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self):
        return operator.getitem, ((RunsCode(self.marker), self.value), 1)


def _train(rank, token_file, directory, **kw):
    return fit(rank, token_file, 2, max_steps=STEPS, callbacks=[PeriodicCheckpoint(directory, 2, keep_last=3)],
               **kw)


@pytest.fixture(scope="module")
def run(token_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    losses = run_distributed(_train, 2, token_file, root / "universal")[0]["losses"]
    run_distributed(fit, 2, token_file, 2, max_steps=2, save_to=str(root / "deepspeed"), checkpoint_format="deepspeed",
                    zero_stage=1)
    return {"root": root, "losses": losses, "steps": {s: root / "universal" / f"step-{s:08d}" for s in (2, 4, 6)},
            "deepspeed": root / "deepspeed"}


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def _resume(rank, token_file, ckpt_path, **kw):
    return fit(rank, token_file, 2, max_steps=STEPS, ckpt_path=str(ckpt_path), **kw)


def _resume_and_tell(rank, token_file, ckpt_path):
    """:func:`_resume`, with what the loader said (its warnings and Lightning's info log)."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _resume(rank, token_file, ckpt_path)
    return dict(result, said="\n".join(said + [str(w.message) for w in caught]))


def _validate(rank, token_file, ckpt_path):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(), logger=False, limit_val_batches=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = LLMModule(TINY, **OPTIM, global_batch_size=GLOBAL_BATCH)
    return trainer.validate(module, datamodule(token_file, val_batches=1), ckpt_path=str(ckpt_path))


def _malicious_metadata(checkpoint, marker):
    metadata = read_dcp_metadata(checkpoint)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCodeThenReturns(marker, metadata)))
    record_checksums(checkpoint)
    with open(checkpoint / ".metadata", "rb") as f:  # the crafted file is a real attack on plain unpickling
        assert type(pickle.load(f)).__name__ == "Metadata" and marker.exists()
    marker.rmdir()


def _malicious_deepspeed(checkpoint, marker):
    states = checkpoint / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(states, weights_only=False), "extra": RunsCode(marker)}, states)
    record_checksums(checkpoint)


def _flip_byte(checkpoint):
    shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def test_universal_metadata_holding_code_is_refused_by_every_entry_point(run, token_file, tmp_path, capfd):
    checkpoint, marker = _copy(run["steps"][2], tmp_path / "step-00000002"), tmp_path / "code_ran"
    _malicious_metadata(checkpoint, marker)
    named = re.escape(str(checkpoint / ".metadata")) + r".*_operator\.getitem"
    with pytest.raises(UnsafeCheckpointError, match=named):
        read_dcp_metadata(checkpoint)
    with pytest.raises(Exception, match=named):
        run_distributed(_resume, 2, token_file, checkpoint)
    with pytest.raises(Exception, match=named):
        run_distributed(_validate, 2, token_file, checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(checkpoint), str(tmp_path / "hf")])
    assert exit_info.value.code == 2 and "_operator.getitem" in capfd.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_deepspeed_format_is_read_only_when_trusted(run, token_file, tmp_path):
    checkpoint, marker = _copy(run["deepspeed"], tmp_path / "deepspeed"), tmp_path / "code_ran"
    assert format_of(checkpoint) == "deepspeed"
    _malicious_deepspeed(checkpoint, marker)
    for checkpoint_format in ("universal", "deepspeed"):  # the run's own format is no consent to unpickling
        with pytest.raises(Exception, match=r"trust_deepspeed_checkpoints=True"):
            run_distributed(_resume, 2, token_file, checkpoint, checkpoint_format=checkpoint_format, zero_stage=1)
    assert not marker.exists()
    run_distributed(_resume, 2, token_file, checkpoint, checkpoint_format="deepspeed", zero_stage=1,
                    trust_deepspeed_checkpoints=True)
    assert marker.exists()  # trusted: DeepSpeed unpickles it, as the setting's name says


def test_damaged_files_are_refused_by_name(run, token_file, tmp_path):
    flipped = _copy(run["steps"][4], tmp_path / "flipped")
    shard = _flip_byte(flipped)
    truncated = _copy(run["steps"][4], tmp_path / "truncated")
    state = truncated / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert checksum_problems(run["steps"][4]) == []
    assert checksum_problems(flipped) == [f"{flipped / shard.name} does not match its recorded checksum (its bytes "
                                          "changed after it was written)"]
    with pytest.raises(Exception, match=re.escape(f"{state} has 100 bytes")):
        run_distributed(_resume, 2, token_file, truncated)
    (flipped / CHECKSUMS).write_text("{")
    assert "checksums.json is unreadable" in checksum_problems(flipped)[0]


def test_resume_auto_skips_other_formats_and_damage_and_continues_exactly(run, token_file, tmp_path):
    """A directory of checkpoints, newest first: step 6 in DeepSpeed's format (holding code), step 4 with a flipped
    byte, step 2 intact. The loader skips the first two, says why, and the run continues from step 2 with the losses
    of the uninterrupted run, bit for bit."""
    directory, marker = tmp_path / "checkpoints", tmp_path / "code_ran"
    _malicious_deepspeed(_copy(run["deepspeed"], directory / "step-00000006"), marker)
    shard = _flip_byte(_copy(run["steps"][4], directory / "step-00000004"))
    _copy(run["steps"][2], directory / "step-00000002")
    resumed = run_distributed(_resume_and_tell, 2, token_file, directory)[0]
    assert resumed["losses"] == run["losses"][2:]
    err = resumed["said"]
    assert "step-00000006 is in DeepSpeed's format" in err and f"{shard.name} does not match" in err, err[-3000:]
    assert f"Loaded the checkpoint of step 2: {directory / 'step-00000002'}" in err, err[-3000:]
    assert not marker.exists()


def test_hugging_face_pickles_are_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(TINY)))
    torch.save({"model.embed_tokens.weight": RunsCode(tmp_path / "code_ran")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickled .bin files are not loaded"):
        load_hf(tmp_path)
    assert not (tmp_path / "code_ran").exists()


def test_metadata_that_rewrites_an_allowed_class_or_declares_byte_entries_is_refused(run, tmp_path):
    """Two attacks that name only allowed types: a BUILD that sets ``PosixPath.exists`` for the whole process (the
    class is left as it was), and a tensor declared a byte entry whose bytes unpickle to code (DCP would load them
    with unrestricted unpickling). Also refused: storage that points outside the checkpoint directory."""
    import pathlib
    from pickle import BINUNICODE, BUILD, EMPTY_DICT, GLOBAL, PROTO, SETITEM, STOP

    checkpoint = _copy(run["steps"][2], tmp_path / "rewrites")

    def text(s: str) -> bytes:
        data = s.encode()
        return BINUNICODE + len(data).to_bytes(4, "little") + data

    # PosixPath, then {"exists": torch.Size} as its BUILD state: would make every Path.exists() return torch.Size()
    rewrite = (PROTO + b"\x02" + GLOBAL + b"pathlib\nPosixPath\n" + EMPTY_DICT + text("exists")
               + GLOBAL + b"torch\nSize\n" + SETITEM + BUILD + STOP)
    (checkpoint / ".metadata").write_bytes(rewrite)
    before = pathlib.PosixPath.exists
    with pytest.raises(UnsafeCheckpointError, match="sets attributes of a type"):
        read_dcp_metadata(checkpoint)
    assert pathlib.PosixPath.exists is before

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    marker = tmp_path / "code_ran"
    byte_entry = _copy(run["steps"][2], tmp_path / "byte_entry")
    metadata = read_dcp_metadata(byte_entry)
    payload = byte_entry / "evil.distcp"
    torch.save(RunsCode(marker), payload)
    metadata.state_dict_metadata["step"] = BytesStorageMetadata()
    metadata.storage_data = {MetadataIndex("step"): _StorageInfo("evil.distcp", 0, payload.stat().st_size)}
    (byte_entry / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):
        read_dcp_metadata(byte_entry)
    assert not marker.exists()

    outside = _copy(run["steps"][2], tmp_path / "outside")
    metadata = read_dcp_metadata(outside)
    metadata.storage_data = {k: _StorageInfo("../elsewhere/" + v.relative_path, v.offset, v.length)
                             for k, v in metadata.storage_data.items()}
    (outside / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="outside its directory"):
        read_dcp_metadata(outside)


def test_every_file_is_recorded_and_a_missing_unlisted_or_unverified_one_is_named(run, token_file, tmp_path, capfd):
    """The checksums list every file a 2-rank save wrote (each rank recorded its share); a deleted file and a file
    added afterwards are named; ``mgpu-export`` refuses a flipped tensor file (DCP alone would load it silently);
    a run writing the DeepSpeed format skips universal checkpoints when searching, and any search skips a checkpoint
    without checksums."""
    import json

    from lightning_mgpu.checkpoint.integrity import checkpoint_files

    step = run["steps"][4]
    assert sorted(json.loads((step / CHECKSUMS).read_text())["files"]) == checkpoint_files(step)
    missing = _copy(step, tmp_path / "missing")
    shard = max(missing.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.unlink()
    (missing / "extra.bin").write_bytes(b"x")
    assert checksum_problems(missing) == [f"{shard} is missing",
                                          f"{missing / 'extra.bin'} was not written with the checkpoint (it has no "
                                          "recorded checksum)"]
    flipped = _copy(step, tmp_path / "flipped")
    name = _flip_byte(flipped).name
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(flipped), str(tmp_path / "hf")])
    assert exit_info.value.code == 2 and f"{name} does not match its recorded checksum" in capfd.readouterr().err
    directory = tmp_path / "checkpoints"
    _copy(run["steps"][2], directory / "step-00000002")
    unverified = _copy(run["steps"][4], directory / "step-00000004")
    (unverified / CHECKSUMS).unlink()
    with pytest.raises(Exception, match=r"step-00000002 is in the universal format and this run writes deepspeed"):
        run_distributed(_resume, 2, token_file, directory, checkpoint_format="deepspeed", zero_stage=1)
    with pytest.raises(Exception, match=r"step-00000004 records no checksums"):
        run_distributed(_resume, 2, token_file, directory, checkpoint_format="deepspeed", zero_stage=1)
