"""Test-suite set-up shared by every tier."""

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# Forked children deadlock in their first matmul if this parent has started an OpenMP pool (see
# lightning_mgpu.testing), so the parent stays single-threaded from the start.
torch.set_num_threads(1)
os.environ.setdefault("MGPU_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mgpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# What building a DeepSpeed engine imports (2-3 s of CPU per process the first time), imported once here: every forked
# rank of every multi-process test inherits it.
from lightning_mgpu.engine import preload  # noqa: E402

preload()
# Ports out of the kernel's ephemeral range, a share per pytest-xdist worker, for Lightning's launches too
from lightning_mgpu.testing import use_free_port_for_lightning  # noqa: E402

use_free_port_for_lightning()
# What the imports made stays out of the session's garbage collections: a full collection would walk it every time.
gc.freeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    from helpers import make_token_file

    return make_token_file(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def ref(token_file):
    """The one single-process reference of the parity tests: the tiny model, ``STEPS`` steps, clipping at 0.3, then one
    validation batch (``val_loss``); every layout of ZeRO, tensor and context parallelism is compared with it."""
    from helpers import STEPS, reference

    return reference(token_file, steps=STEPS, clip=0.3, val_batches=1)


#: Every store the tests served: kept referenced for the whole session. A store that becomes garbage (logging
#: records of a test's error can hold it past the test's teardown) may be collected later in a process forked by
#: another test, where its server thread does not exist, and that aborts the child (SIGABRT).
_SERVED_STORES: list = []


@pytest.fixture
def tcp_store():
    """A rendezvous store for 2 ranks served by this process, for the whole session (see ``_SERVED_STORES``)."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_mgpu.testing import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    _SERVED_STORES.append(store)
    return store
