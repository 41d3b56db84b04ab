"""A local rank > 0 of an ``mgpu-train`` job: ``python -m lightning_mgpu.cli.worker RUN_DIR``.

It trains from the resolved ``config.yaml`` that the first process wrote into ``RUN_DIR``, instead of
composing the config again (see :mod:`lightning_mgpu.launcher`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from lightning_mgpu.cli.config import TrainConfig
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.cli.train import CONFIG_NAME, train


def main(run_dir: str) -> None:
    skip_final_garbage_collection()
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(Path(run_dir) / CONFIG_NAME))
    train(cfg, Path(run_dir), worker=True)


if __name__ == "__main__":
    main(sys.argv[1])
