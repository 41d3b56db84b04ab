"""Reference models: plain PyTorch, nothing distributed."""

from lightning_mgpu.models.llama import LLAMA_SHAPES, Llama, LlamaConfig

__all__ = ["LLAMA_SHAPES", "Llama", "LlamaConfig"]
