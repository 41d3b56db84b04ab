"""``python -m lightning_mgpu.train``: the same as ``mgpu-train``."""

from lightning_mgpu.cli.train import main

if __name__ == "__main__":
    main()
