"""The NCCL settings a run starts with: the communicator aborted and the error raised in Python (so the survivors'
report prints), the Flight Recorder dumped into the run directory; a user's own value wins; gloo untouched."""

import os

from lightning_mgpu.resilience.nccl import apply_nccl_settings

NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE",
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def test_nccl_gets_the_settings_the_user_left_unset(monkeypatch, tmp_path):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's choice
    assert apply_nccl_settings("gloo", tmp_path) == {} and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    apply_nccl_settings("cpu:gloo,cuda:nccl", tmp_path)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # torch's default, 3, exits before Python sees it
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert int(os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0  # the dump needs a recorder
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl-trace-rank-"
