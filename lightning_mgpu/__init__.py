"""lightning_mgpu: tensor, pipeline and ZeRO (DeepSpeed) parallelism for lightning.Trainer.

Importing the package registers the strategy names ``mgpu``, ``mgpu_zero1``, ``mgpu_zero2``,
``mgpu_zero3`` and ``mgpu_zero3_offload`` with Lightning.
"""

from lightning_mgpu.contract import ParallelModule
from lightning_mgpu.engine.config import parameter_shape
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.module import LLMModule
from lightning_mgpu.precision import MGPUPrecision
from lightning_mgpu.strategy import MGPUStrategy

__all__ = ["LLMModule", "MGPUPrecision", "MGPUStrategy", "ParallelLayout", "ParallelModule", "parameter_shape"]
__version__ = "0.1.0"
