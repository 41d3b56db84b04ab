"""Reference models: plain PyTorch, nothing distributed."""

from lightning_mgpu.models.llama import LLAMA_SHAPES, Llama, LlamaConfig
from lightning_mgpu.models.llama_plan import LLAMA_TP_PLAN, llama_tp_plan

__all__ = ["LLAMA_SHAPES", "LLAMA_TP_PLAN", "Llama", "LlamaConfig", "llama_tp_plan"]
