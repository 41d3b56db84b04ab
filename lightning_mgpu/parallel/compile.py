"""``torch.compile`` of a model's blocks, applied by the parallelisation step (:func:`parallelize`) after the
tensor-parallel plan, the stage split and activation checkpointing, or by the module itself outside MGPUStrategy. The
model file only names the option (``LlamaConfig.compile``).

Each block is compiled in place (``nn.Module.compile``: its ``forward`` runs through the compiler, names and
parameters unchanged), one block at a time rather than the whole model: the blocks are identical, so the compiler
traces one and reuses its code for the others, and what lies between blocks (pipeline stage boundaries, the
embedding and head of a vocabulary-parallel plan, DeepSpeed's hooks) stays eager.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

#: The attribute a compiled block carries: its backend.
MARK = "compiled_with"


def compile_backend_problems(backend: str, key: str) -> list[str]:
    """The one rule for a compile backend, worded with the config ``key`` that set it: one ``torch.compile`` knows."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())  # aot_eager is tagged "debug"
    if backend in known:
        return []
    return [f"{key}={backend!r} is not a torch.compile backend; choose inductor (fused kernels) or aot_eager (traces "
            "forward and backward, generates no code), or another name torch._dynamo.list_backends() knows"]


def compile_layout_problems(zero_stage: int, key: str = "compile") -> list[str]:
    """The one rule for where compiled blocks pay: not under ZeRO-3, whose engine gathers each layer's parameter
    partitions in module hooks that ``torch.compile`` must not trace (DeepSpeed marks them so): every submodule becomes
    a graph break, and the blocks run as many small graphs (measured: 14 graphs and a break per submodule for a 2-block
    model). It trains correctly, but compiling buys nothing, so it is refused rather than run slower."""
    if zero_stage == 3:
        return [f"{key}=true cannot compile blocks under ZeRO-3 (zero_stage=3): DeepSpeed gathers every layer's "
                "partitions in hooks torch.compile cannot trace, which breaks each block into small graphs; use "
                "zero_stage 1 or 2 with compile, or compile=false"]
    return []


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor") -> int:
    """Compile every block of ``blocks`` with ``backend`` (a ``torch.compile`` backend: ``inductor`` generates fused
    kernels, ``aot_eager`` traces forward and backward without generating code); a block already compiled is left as
    it is. Returns the number of blocks compiled."""
    changed = 0
    for block in blocks:
        if getattr(block, MARK, None) is not None:
            continue
        block.compile(backend=backend)
        setattr(block, MARK, backend)
        changed += 1
    return changed
