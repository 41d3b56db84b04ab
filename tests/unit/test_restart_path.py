"""What a restarted rank no longer does again, without processes: the config digest the ranks compare (JSON of the
resolved values) still tells two configs apart, and the checkpoint reader takes the metadata a load already read."""

import pytest
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mgpu.checkpoint.safe_reader import SafeFileSystemReader
from lightning_mgpu.cli.train import SameConfigOnEveryRank


def test_the_config_digest_tells_a_changed_value_and_not_an_interpolation():
    base = {"model": {"dim": 32, "n_layers": 2}, "optim": {"lr": 0.003}, "seed": 7, "name": "run-${seed}"}
    same = OmegaConf.create({**base, "name": "run-7"})  # resolved, as config.yaml is written
    changed = OmegaConf.create({**base, "optim": {"lr": 0.0031}})
    digest = SameConfigOnEveryRank(OmegaConf.create(base)).digest
    assert SameConfigOnEveryRank(same).digest == digest
    assert SameConfigOnEveryRank(changed).digest != digest


def test_the_reader_returns_the_metadata_it_was_given_without_reading_the_file(tmp_path):
    """No ``.metadata`` file exists: the reader given what the load read returns it (with this load's id); without it,
    it reads the file, which fails here."""
    read = Metadata(state_dict_metadata={})
    got = SafeFileSystemReader(tmp_path, read).read_metadata()
    assert got is read and got.storage_meta is not None
    with pytest.raises(OSError):
        SafeFileSystemReader(tmp_path).read_metadata()
