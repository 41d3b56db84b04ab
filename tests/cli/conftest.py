"""What the CLI tests of failures share: one uninterrupted ``mgpu-train`` run of the tiny model, 6 steps at ZeRO-1
on 2 processes, the losses every interrupted-then-resumed run must end with."""

import pytest
from cli_helpers import BIN, RESTARTABLE, cli_args, read_losses, run


@pytest.fixture(scope="session")
def uninterrupted_losses(token_file, tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), *RESTARTABLE, f"hydra.run.dir={directory / 'run'}"],
        directory)
    return read_losses(directory / "run" / "metrics.csv")
