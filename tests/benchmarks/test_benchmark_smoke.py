"""Every benchmark given a smoke mode runs in it here, so none can rot: it must finish and print its figure (timings
are never asserted). Their full runs are ``make benchmarks``."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: benchmark -> a line its output must hold (its table's header)
SMOKE = {"checkpoint_verify.py": "verify alone"}


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke_mode_runs_and_prints_its_figure(script):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, *rows = [line for line in proc.stdout.splitlines() if SMOKE[script] in line or "%" in line]
    assert SMOKE[script] in header and rows, proc.stdout[-3000:]
