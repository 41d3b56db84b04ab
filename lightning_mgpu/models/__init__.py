"""Reference models: plain PyTorch, nothing distributed."""

from lightning_mgpu.models.llama import Llama, LlamaConfig
from lightning_mgpu.models.llama_config import LLAMA_SHAPES
from lightning_mgpu.models.llama_plan import LLAMA_TP_PLAN, llama_tp_plan

__all__ = ["LLAMA_SHAPES", "LLAMA_TP_PLAN", "Llama", "LlamaConfig", "llama_tp_plan"]
