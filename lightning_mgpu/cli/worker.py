"""A rank of an ``mgpu-train`` job that is not forked: ``python -m lightning_mgpu.cli.worker RUN_DIR``.

It trains from the resolved ``config.yaml`` that the first process wrote into ``RUN_DIR``, instead of composing the
config again: local ranks 1..N-1 started by Lightning's launcher (see :mod:`lightning_mgpu.launcher` and
:func:`lightning_mgpu.cli.train.train_worker`), and every rank of a job under the elastic agent once CUDA is in use
(:mod:`lightning_mgpu.resilience.elastic`). ``@record`` leaves a failure's traceback where the agent reads it.
"""

from __future__ import annotations

import functools
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from lightning_mgpu.cli.errors import run_rank
from lightning_mgpu.cli.quiet import quiet_known_warnings
from lightning_mgpu.cli.train import train_worker


@record
def main() -> None:
    quiet_known_warnings()
    run_rank(functools.partial(train_worker, sys.argv[1]))


if __name__ == "__main__":
    main()
