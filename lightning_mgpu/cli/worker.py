"""A local rank > 0 of an ``mgpu-train`` job: ``python -m lightning_mgpu.cli.worker RUN_DIR``.

It trains from the resolved ``config.yaml`` that the first process wrote into ``RUN_DIR``, instead of
composing the config again (see :mod:`lightning_mgpu.launcher` and :func:`lightning_mgpu.cli.train.train_worker`).
"""

from __future__ import annotations

import sys

from lightning_mgpu.cli.quiet import quiet_known_warnings
from lightning_mgpu.cli.train import train_worker

if __name__ == "__main__":
    quiet_known_warnings()
    train_worker(sys.argv[1])
