"""The GPU acceptance check (``make gpu-check``): on one CUDA GPU, the CUDA tests and the GPU benchmarks in one run, then
one table with each figure beside its expectation. Budget: under 8 minutes on one H100/H200.

What it runs, each as its own process (a failure of one does not hide the others):

* ``pytest -m gpu tests/gpu``: bf16 training with NCCL at ZeRO 0/2/3, a LoRA step in bf16 at ZeRO 2/3 (communication overlap on by default from ZeRO-2),
  the context-parallel CUDA attention kernel against whole causal attention, fp8's GEMMs against torchao's
  ``Float8Linear`` and fp8 training with its size refusal, and (with two GPUs or more; skipped on one) a lost rank on
  NCCL named by the survivor;
* ``gpu_llama_mfu.py``: bf16-mixed MFU of llama3_1b, against the bf16 matmul peak measured in the same run;
* ``gpu_planner_check.py``: the planner's peak memory and step time against measurement, with no, selective and
  full recomputation;
* ``compile_blocks.py --cuda``: compile's speed-up of the blocks;
* ``gpu_fp8.py``: fp8 (rowwise, tensorwise) step time and tokens/s against bf16, side by side;
* ``gpu_lora_strategies.py``: a PEFT LoRA model's step time and peak memory under ``MGPUStrategy(zero_stage=2)``
  against Lightning's ``DeepSpeedStrategy(stage=2)``, which runs only on CUDA;
* ``pipeline_overlap.py --cuda``: DualPipeV's forward / backward pairs overlapped against sequential at ep2 x pp2 with
  NCCL (with 4 GPUs or more; on fewer it prints that it did not run).

Without CUDA it refuses (exit status 2) naming what is missing. ``--smoke`` runs every check but the CUDA tests in its
smoke mode, in this process (the CPU without a GPU): the table then shows that the check runs, not what the GPU does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from record import recorded
from smoke import SMOKE

HERE = Path(__file__).resolve().parent
#: Seconds one check may take before it is stopped (the whole check stays under 8 minutes on one GPU).
TIMEOUT = 240


@dataclass(frozen=True)
class Reading:
    """One figure of a check's output, beside what it should be."""

    name: str
    figure: Callable[[str], Optional[str]]  #: the figure read from the output, None if it is not there
    expectation: str
    passes: Callable[[str], bool]  #: whether the figure meets the expectation


@dataclass(frozen=True)
class Check:
    command: Optional[list[str]]  #: None: not run here (the CUDA tests in the smoke mode: every one would skip)
    readings: list[Reading]


def _found(pattern: str, flags: int = 0) -> Callable[[str], Optional[str]]:
    return lambda text: ", ".join(re.findall(pattern, text, flags)) or None


def _each(test: Callable[[float], bool]) -> Callable[[str], bool]:
    return lambda figure: all(test(float(x)) for x in figure.split(", "))


def checks() -> list[Check]:
    python, smoke = [sys.executable], ["--smoke"] if SMOKE else []
    tests = Reading("CUDA tests: NCCL bf16 at ZeRO 0/2/3 with overlap on, the context-parallel kernel",
                    _found(r"(\d+ passed|\d+ skipped|\d+ failed|\d+ errors?)"), "every test passed",
                    lambda f: "failed" not in f and "error" not in f and "passed" in f)
    mfu = Reading("bf16 MFU of llama3_1b on one GPU", _found(r"MFU (\d+\.\d)%"),
                  ">= 30% (published bf16 runs: 40-50%)", _each(lambda x: x >= 30))
    memory = Reading("planner / measured peak memory (none, selective, full)",
                     _found(r"^\| \w+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", re.M), "each 0.85-1.25",
                     _each(lambda x: 0.85 <= x <= 1.25))
    step = Reading("planner / measured step time (none, selective, full)", _found(r"\| ([\d.]+) \|$", re.M),
                   "each 0.75-1.33 (the calibration's +-25%)", _each(lambda x: 0.75 <= x <= 1.33))
    compiled = Reading("compile's speed-up of the blocks (none, selective, full)", _found(r" ([\d.]+)$", re.M),
                       "each >= 1.0", _each(lambda x: x >= 1.0))
    fp8 = Reading("fp8 rowwise tokens/s over bf16 on one GPU (llama3_1b, eager)",
                  _found(r"fp8 rowwise speed-up over bf16: ([+-]\d+\.\d)%"),
                  "+10-25 % at 1B-8B (torchao, compiled); > 0 to pass", _each(lambda x: x > 0))
    lora = Reading("LoRA step time, MGPUStrategy(zero_stage=2) / Lightning's DeepSpeedStrategy(stage=2)",
                   _found(r"DeepSpeedStrategy \(LoRA, ZeRO-2, one GPU\): step ([\d.]+)"),
                   "<= 1.0 (and peak memory <= 1.0, printed beside it)", _each(lambda x: x <= 1.0))
    overlap = Reading("DualPipeV step time, overlapped / sequential pairs (ep2 x pp2, 4 GPUs)",
                      _found(r"ratio overlapped / sequential: ([\d.]+|not run: .*)"),
                      "<= 1.0 (the all-to-alls hide under the other action); not run with fewer than 4 GPUs",
                      lambda f: f.startswith("not run") or _each(lambda x: x <= 1.0)(f))
    cuda_tests = None if SMOKE else python + ["-m", "pytest", "-q", "-m", "gpu", str(HERE.parent / "tests" / "gpu")]
    return [Check(cuda_tests, [tests]),
            Check(python + [str(HERE / "gpu_llama_mfu.py"), *smoke], [mfu]),
            Check(python + [str(HERE / "gpu_planner_check.py"), *smoke], [memory, step]),
            Check(python + [str(HERE / "compile_blocks.py"), *(smoke or ["--cuda"])], [compiled]),
            Check(python + [str(HERE / "gpu_fp8.py"), *smoke], [fp8]),
            Check(python + [str(HERE / "gpu_lora_strategies.py"), *smoke], [lora]),
            Check(python + [str(HERE / "pipeline_overlap.py"), "--cuda", *smoke], [overlap])]


def in_this_process(command: list[str]) -> subprocess.CompletedProcess:
    """The smoke mode: run a script (``python SCRIPT ARGS``) in this process, which has imported torch, Lightning and
    DeepSpeed already (seconds instead of an interpreter each), capturing what it prints."""
    import contextlib
    import io
    import runpy

    out, code, argv = io.StringIO(), 0, sys.argv
    sys.argv = command[1:]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(command[1], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    finally:
        sys.argv = argv
        if torch.distributed.is_initialized():  # a one-process Trainer's group: leave the process as it was
            torch.distributed.destroy_process_group()
    return subprocess.CompletedProcess(command, code, out.getvalue(), "")


def run(check: Check) -> list[tuple[Reading, str, str]]:
    """(reading, figure or what went wrong, verdict) of each reading of one check."""
    if check.command is None:
        return [(r, "-", "not run (smoke: needs a GPU)") for r in check.readings]
    try:
        proc = in_this_process(check.command) if SMOKE else \
            subprocess.run(check.command, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return [(r, f"stopped after {TIMEOUT} s", "FAIL") for r in check.readings]
    failed = proc.returncode != 0 and "pytest" not in check.command
    tail = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1][:100]
    out = []
    for reading in check.readings:
        figure = reading.figure(proc.stdout)
        if figure is None or failed:
            out.append((reading, f"exit {proc.returncode}: {tail}", "FAIL"))
        else:
            out.append((reading, figure, "ran (smoke)" if SMOKE else "ok" if reading.passes(figure) else "FAIL"))
    return out


def main() -> int:
    if not (torch.cuda.is_available() or SMOKE):
        print(f"gpu-check needs CUDA: torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False; built "
              f"with CUDA {torch.version.cuda or 'none'}). Run it on a machine with an NVIDIA GPU and a CUDA build of "
              "torch, or with --smoke to check that it runs")
        return 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
    print(f"gpu-check on {device}")
    print("| check | figure | expectation | verdict |")
    print("|---|---|---|---|")
    failed, start = 0, time.perf_counter()
    for check in checks():
        for reading, figure, verdict in run(check):
            failed += verdict == "FAIL"
            print(f"| {reading.name} | {figure} | {reading.expectation} | {verdict} |", flush=True)
    print(f"{failed} check(s) failed; {time.perf_counter() - start:.0f} s in all")
    return 1 if failed else 0


def recorded_main() -> int:
    """:func:`main`, its table written as the measurements page's GPU section where CUDA ran it, failed checks
    included (a refusal, or the smoke mode, writes nothing)."""
    if not torch.cuda.is_available():
        return main()
    with recorded(__file__, "One GPU: `make gpu-check`", about=__doc__.split("\n\nWithout CUDA")[0], markdown=True):
        return main()


if __name__ == "__main__":
    sys.exit(recorded_main())
