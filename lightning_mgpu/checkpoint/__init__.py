"""Checkpoint formats: universal (layout-independent) checkpoints, consolidated weights, their integrity and the
restricted reader; Hugging Face import and export live in ``lightning_mgpu.hf``."""
