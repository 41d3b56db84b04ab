"""GPU and cluster specifications the planner and the throughput callback use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GPUSpec:
    """One GPU kind: memory, dense bf16 peak, per-GPU bandwidths inside a node (NVLink) and across nodes, and the
    fractions of the peak that training's matmuls and attention reach on it (fitted to published runs of comparable
    stacks: :mod:`lightning_mgpu.planner.calibration`; how they are used: :mod:`lightning_mgpu.planner.efficiency`)."""

    name: str
    memory_bytes: float
    bf16_peak_flops: float
    intra_node_bandwidth: float  #: bytes/s per GPU per direction (NVLink)
    inter_node_bandwidth: float  #: bytes/s per GPU per direction (InfiniBand / RoCE)
    #: fraction of ``bf16_peak_flops`` that the model's weight matmuls reach in large micro-batches
    achievable: float = 0.5
    #: fraction of ``bf16_peak_flops`` that the fused attention kernel reaches on the scores (None: ``achievable``)
    attention_achievable: Optional[float] = None
    #: tokens per micro-batch and rank at which the matmuls reach half of ``achievable``
    #: (:mod:`lightning_mgpu.planner.efficiency`); 0: every micro-batch at ``achievable``
    saturation_tokens: float = 0.0
    #: watts at the board's power limit (the published TDP): what a run's energy is planned at; None: unknown
    board_power_w: Optional[float] = None


#: Published dense bf16 peaks (no sparsity) and typical HGX interconnects (one 200/400 Gb/s NIC per GPU). The compute
#: constants (matmul and attention fractions, saturation tokens) are fitted by
#: ``lightning_mgpu.planner.calibration.fit_constants`` to the fitting set of published runs alone (A100: 6 runs,
#: H100: 9), and judged on a held-out set (``python benchmarks/planner_calibration.py``); the H200 has the H100's
#: compute and no published bf16 run here with settings the planner takes, so it takes the H100's. Board powers: the
#: SXM modules' published maximum TDPs (A100 400 W, H100 700 W, H200 700 W).
GPUS: dict[str, GPUSpec] = {
    "a100_80gb": GPUSpec("A100-SXM4-80GB", 80e9, 312e12, 300e9, 25e9, achievable=0.7225, attention_achievable=0.29,
                           saturation_tokens=896, board_power_w=400.0),
    "h100_80gb": GPUSpec("H100-SXM5-80GB", 80e9, 989e12, 450e9, 50e9, achievable=0.58, attention_achievable=0.155,
                           saturation_tokens=896, board_power_w=700.0),
    "h200_141gb": GPUSpec("H200-SXM-141GB", 141e9, 989e12, 450e9, 50e9, achievable=0.58, attention_achievable=0.155,
                            saturation_tokens=896, board_power_w=700.0),
}


def gpu_by_device_name(device_name: str) -> Optional[GPUSpec]:
    """The preset whose kind appears in a CUDA device name (``torch.cuda.get_device_name()``), if any."""
    name = device_name.upper()
    for key, spec in GPUS.items():
        kind = key.split("_")[0].upper()
        if kind in name and (kind != "H100" or "H200" not in name):
            return spec
    return None


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind."""

    nodes: int
    gpus_per_node: int
    gpu: GPUSpec

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
