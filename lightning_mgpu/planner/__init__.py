"""Memory and step-time model of a training layout, and a search over layouts. Imports nothing distributed."""

from lightning_mgpu.planner.hardware import GPUS, ClusterSpec, GPUSpec
from lightning_mgpu.planner.memory import MemoryEstimate, estimate_memory
from lightning_mgpu.planner.model_stats import model_flops_per_token, rank_parameters
from lightning_mgpu.planner.search import Candidate, PlanRow, plan_layouts
from lightning_mgpu.planner.time import StepTimeEstimate, estimate_step_time

__all__ = ["GPUS", "Candidate", "ClusterSpec", "GPUSpec", "MemoryEstimate", "PlanRow", "StepTimeEstimate",
           "estimate_memory", "estimate_step_time", "model_flops_per_token", "plan_layouts", "rank_parameters"]
