"""fp8 matmuls as a precision setting: torchao's dynamic scaling on every linear layer the model computes, with each
scale that spans a split of the parallel layout reduced over it (each layout's first step casts as one process does;
later steps drift as fp8 rounds the layouts' fp32 reduction orders apart: docs, concepts/precision.md).

* :mod:`~lightning_mgpu.fp8.scaling`: the fp8 linear (torchao's casts and GEMMs, amax reduced over splits);
* :mod:`~lightning_mgpu.fp8.grouped`: the grouped experts' fp8 (per expert, per token group);
* :mod:`~lightning_mgpu.fp8.convert`: which layers convert, and the sizes the GPU kernels refuse.

``MGPUPrecision(..., fp8="rowwise")`` turns it on (``lightning_mgpu.precision``).
"""

import logging

#: (logger, part of a message it logs while torchao is imported, why it is harmless here)
_IMPORT_NOISE = (
    ("torchao", "Failed to load", "torchao's wheel carries CUDA extension libraries (mxfp8, CUTLASS kernels) built for "
     "another Python or for CUDA; the float8 training path used here calls none of them"),
    ("torchao.kernel.intmm", "Detected no triton", "torchao's int8 matmul kernels need Triton, which a CPU build of "
     "torch lacks; the float8 training path uses none of them"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile", "torchao "
     "registers its enums the way torch 2.13 deprecates; it changes nothing at run time"),
)


def _not_import_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and start in record.getMessage() for name, start, _ in _IMPORT_NOISE)


for _name, _start, _why in _IMPORT_NOISE:
    logging.getLogger(_name).addFilter(_not_import_noise)

from lightning_mgpu.fp8.convert import Fp8Linear, convert_to_fp8, kernel_size_problems, local_sizes
from lightning_mgpu.fp8.scaling import Fp8Spec, Splits, fp8_linear

__all__ = ["Fp8Linear", "Fp8Spec", "Splits", "convert_to_fp8", "fp8_linear", "kernel_size_problems",
           "local_sizes"]
