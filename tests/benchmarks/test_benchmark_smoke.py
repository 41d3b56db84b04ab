"""Every benchmark runs in its smoke mode here, so none can rot: it must finish and print its figure (timings are never
asserted). Their full runs are ``make benchmarks`` (CPU) and ``make gpu-check`` (one GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: benchmark -> a line its output must hold (its table's header, or the line with its figure)
SMOKE = {
    "activation_memory.py": "| shape | precision | checkpointing |",
    "async_checkpoint.py": "async / sync",
    "chaos_goodput.py": "effective training time",
    "checkpoint_io.py": "save s",
    "checkpoint_verify.py": "verify alone",
    "context_parallel.py": "MB sent per rank",
    "document_mask.py": "document mask ms",
    "moe_throughput.py": "all-to-all",
    "overhead.py": "overhead ratio (ours / hand-written)",
    "pipeline_bubble.py": "worst excess over theory",
    "pipeline_in_flight.py": "planned >= measured",
    "planner_calibration.py": "| run | GPUs | layout |",
    "replica_updates.py": "| update | train loss",
    "setup_memory.py": "first-step peak GB",
    "tp_vs_dtensor.py": "ratio ours/theirs",
    "zero_memory.py": "worst measured / paper ratio",
    # runs gpu_llama_mfu.py, gpu_planner_check.py and compile_blocks.py in their smoke modes and tabulates them
    "gpu_check.py": "| check | figure | expectation | verdict |",
}
#: run by gpu_check.py (its smoke table shows each ran), or not a benchmark
COVERED = {"gpu_llama_mfu.py", "gpu_planner_check.py", "compile_blocks.py", "smoke.py"}


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts - COVERED == set(SMOKE), "add the new benchmark's --smoke run to SMOKE"


@pytest.fixture(scope="module")
def smoke_outputs() -> dict[str, tuple[int, str]]:
    """Every script's (exit code, output) of its --smoke run, all in one process (``run_smoke.py``), imported once."""
    # gpu_check.py last: it trains in this process (one-process Trainers), the others fork their ranks from it
    scripts = [str(BENCHMARKS / name) for name in sorted(SMOKE, key=lambda name: (name == "gpu_check.py", name))]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("run_smoke.py")), *scripts],
                          capture_output=True, text=True, timeout=900)
    out, current, lines = {}, None, []
    for line in proc.stdout.splitlines():
        if line.startswith("=== start "):
            current, lines = line.split()[-1], []
        elif line.startswith("=== end ") and current is not None:
            out[current] = (int(line.split()[-1]), "\n".join(lines))
            current = None
        elif current is not None:
            lines.append(line)
    assert set(out) == set(SMOKE), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke_mode_runs_and_prints_its_figure(script, smoke_outputs):
    code, output = smoke_outputs[script]
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    marked = [i for i, line in enumerate(lines) if SMOKE[script] in line]
    assert marked, output[-3000:]
    figures = [line for line in lines[marked[0]:] if any(c.isdigit() for c in line)]
    assert figures, output[-3000:]
    if script == "gpu_check.py":  # every check ran and read its figure
        rows = [line for line in lines if line.startswith("| ") and "expectation" not in line and "---" not in line]
        assert len(rows) == 5 and all("ran (smoke)" in row or "not run" in row for row in rows), output


def test_gpu_check_refuses_without_cuda_naming_what_is_missing():
    """Run with every GPU hidden, so that it also runs (rather than skips) on a machine that has one."""
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, env=environ)
    assert proc.returncode == 2 and "gpu-check needs CUDA" in proc.stdout and "--smoke" in proc.stdout, proc.stdout
