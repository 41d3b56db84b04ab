"""Every benchmark runs in its smoke mode here, so none can rot: it must finish and print its figure (timings are never
asserted). Their full runs are ``make benchmarks`` (CPU) and ``make gpu-check`` (one GPU)."""

import math
import re
import runpy
import subprocess
import sys
import threading
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
    "comm_count.py": "ratio with / without",
    "context_parallel.py": "MB sent per rank",
    "document_mask.py": "document mask ms",
    "fault_matrix.py": "runs ended bit-identical to the fault-free run",
    "resilience_cost.py": "ms per million parameters",
    "fingerprint_step.py": "the check every step costs",
    "fp8_curve.py": "| layout | recipe | step 1 | step 2 |",
    "hf_families.py": "| family | layout | step-1 grad norm diff | max loss diff | verdict |",
    "hf_moe_ep.py": "ratio ep2 / ep1 (transformers)",
    "hf_step_time.py": "ratio transformers / LLMModule",
    "lora_step.py": "ratio LoRA / full fine-tuning",
    "moe_throughput.py": "all-to-all",
    "muon_step.py": "ratio Muon / AdamW",
    "overhead.py": "overhead ratio (ours / hand-written)",
    "pipeline_bubble.py": "worst excess over theory",
    "pipeline_in_flight.py": "planned >= measured",
    "pipeline_overlap.py": "ratio overlapped / sequential",
    "planner_calibration.py": "| run | GPUs | layout |",
    "replica_updates.py": "| update | train loss",
    "setup_memory.py": "first-step peak GB",
    "sft_data.py": "/s per process",
    "tp_vs_hf_tp.py": "ratio MGPUStrategy / transformers",
    "vs_deepspeed_strategy.py": "ZeRO-3: MGPUStrategy",
    "tp_vs_dtensor.py": "ratio ours/theirs",
    "zero_memory.py": "worst measured / paper ratio",
    # runs gpu_llama_mfu.py, gpu_planner_check.py and compile_blocks.py in their smoke modes and tabulates them
    "gpu_check.py": "| check | figure | expectation | verdict |",
}
_N = r"(\d+\.\d+)"  # a figure as the benchmarks print it: never nan or inf
#: benchmark -> (a pattern whose groups are its figures, and the open range each must lie in): at least one match,
#: every figure finite and in range. Ranges are wide (timings on busy cores), but exclude 0 where 0 means "not run".
FIGURES = {
    "activation_memory.py": [(r"\| (\d\.\d{3}) \|", 0.5, 2.0)],  # measured / predicted, block and model
    "async_checkpoint.py": [(r"\s(\d+\.\d)%\s", 0.0, 1000.0)],
    "chaos_goodput.py": [(r"effective training time (\d+\.\d)%", 5.0, 1000.0)],
    "checkpoint_io.py": [(rf"dp2-zero1\s+{_N}\s+{_N}\s+{_N}$", 0.0, 600.0)],  # save s, load s, MB
    "checkpoint_verify.py": [(rf"^\s+tiny\s+\S+\s+\d+\s+{_N}\s+{_N}\s+{_N}\s+{_N}\s", 0.0, 600.0)],
    "context_parallel.py": [(rf"^\s+2\s+balanced\s.*\s{_N}$", 0.0, 100.0)],  # MB sent with 2 context ranks
    "document_mask.py": [(rf"^\s+\d+\s+{_N}\s+{_N}\s+{_N}$", 0.0, 1e5)],
    "resilience_cost.py": [(rf"= {_N} ms per million parameters", 0.0, 1e4)],
    "fingerprint_step.py": [(rf"check {_N} ms, rest of the step {_N} ms", 0.0, 1e5)],
    "fault_matrix.py": [(r"^\| \S+ \| \S+ \| [01] \| bit-identical \| ([1-9]) \| (\d+\.\d) \|$", 0.5, 600.0)],  # restarts, s
    "fp8_curve.py": [(r"^\| tp2 \| rowwise \| (\d\.\de[+-]\d\d) \|", -1.0, 1e-5),  # step 1's loss against one process
                     (r"fp8's own effect, .* max (\d\.\de[+-]\d\d)", 0.0, 1.0)],
    "hf_families.py": [(r"^\| gemma2 \| tp2 \+ SP \| (\d\.\de[+-]\d\d) \| (\d\.\de[+-]\d\d) \| exact \|$",
                        -1.0, 1e-5)],  # grad norm and loss against one process
    "hf_moe_ep.py": [(rf"ratio ep2 / ep1 \(transformers\): step {_N}, memory {_N}", 0.01, 100.0),
                     (rf"ratio transformers / package at ep2: step {_N}, memory {_N}", 0.01, 100.0)],
    "hf_step_time.py": [(rf"ratio transformers / LLMModule: {_N}", 0.05, 100.0)],
    "lora_step.py": [(rf"ratio LoRA / full fine-tuning \(MGPUStrategy ZeRO-2, dp2\): step {_N}, memory {_N}", 0.01, 100.0),
                     (rf"ratio MGPUStrategy ZeRO-2 / DDPStrategy \(LoRA, dp2\): step {_N}, memory {_N}", 0.01, 100.0)],
    "moe_throughput.py": [(r"expert parallel 2: ([\d,]+) tokens/s \((\d+) ms", 0.0, 1e9),
                          (rf"expert parallel 2: .* all-to-all {_N} MB a step per rank, planner {_N} MB", 0.0, 100.0)],
    "muon_step.py": [(rf"ratio Muon / AdamW: {_N}", 0.05, 100.0),
                     (rf"optimizer state on rank 0: AdamW {_N} MB, Muon {_N} MB", 0.0, 1e4)],
    "overhead.py": [(rf"overhead ratio \(ours / hand-written\): {_N}", 0.05, 100.0)],
    "pipeline_bubble.py": [(r"^1f1b\s+2\s+4\s+(\d+\.\d)%\s+(\d+\.\d)%", 0.0, 100.0),
                           (r"worst excess over theory: ([+-]\d+\.\d) percentage points", -100.0, 100.0)],
    "pipeline_overlap.py": [(rf"ratio overlapped / sequential: {_N}", 0.05, 100.0),
                            (r"max difference overlapped - sequential: loss (\d\.\de[+-]\d\d), grad norm "
                             r"(\d\.\de[+-]\d\d)", -1.0, 1e-6)],  # exact: the same sums in the same order
    "pipeline_in_flight.py": [(r"\| \[(\d+), (\d+)\] \| \[(\d+), (\d+)\] \| yes \|", 0.0, 9.0)],
    "planner_calibration.py": [(r"\| ([\d,]+) \| ([\d,]+) \| [+-]\d+% \|", 1.0, 1e7)],  # published, predicted
    "replica_updates.py": [(rf"^\| (?:sync|local|async)[^|]* \| {_N} \| {_N} \|", 0.0, 20.0),  # losses
                           (r"^\| (?:sync|local|async)[^|]* \| [\d.]+ \| [\d.]+ \| ([\d,]+) \|", 0.0, 1e10)],
    "setup_memory.py": [(rf"\| {_N} \| \d+\.\d+ \| \d+\.\d \|$", 0.0, 1000.0)],  # first-step peak GB per rank
    "sft_data.py": [(rf"prefix-diff\s+1 process\(es\): [\d,]+ conversations in {_N} s", 0.0, 1e4),
                    (rf"seq_len\s+256: [\d,]+ sequences, (\d+\.\d)% conversation tokens", 0.0, 100.0),
                    (rf"ratio padded / packed, time of a pass: {_N}", 0.05, 100.0)],
    "comm_count.py": [(rf"ratio with / without: {_N}", 0.01, 1000.0)],
    "tp_vs_dtensor.py": [(rf"ratio ours/theirs = {_N}", 0.01, 100.0)],
    "tp_vs_hf_tp.py": [(rf"ratio MGPUStrategy / transformers: {_N}x", 0.01, 100.0),
                       (r"largest loss difference over \d+ steps: (\d\.\de[+-]\d\d)", 0.0, 1e-4),
                       *[(rf"^  {side}: matmuls {_N} s, attention {_N} s, other operators {_N} s, "
                          rf"outside operators {_N} s \(step {_N} s\)", -1e-9, 1e3)
                         for side in ("MGPUStrategy", "transformers")]],
    "vs_deepspeed_strategy.py": [(rf"ZeRO-2: MGPUStrategy {_N} s", 0.0, 1e3)],
    "zero_memory.py": [(rf"worst measured / paper ratio: {_N}", 0.1, 100.0)],
    # on CPU the planner's GPU step time over the measured CPU one prints as 0.00: not bounded here
    "gpu_check.py": [(r"\| bf16 MFU of \S+ on one GPU \| (\d+\.\d) \|", 0.0, 100.0),
                     (rf"peak memory \(none, selective, full\) \| {_N}, {_N}, {_N} \|", 0.0, 100.0),
                     (rf"speed-up of the blocks .* \| {_N} \|", 0.0, 100.0),
                     (r"fp8 rowwise tokens/s over bf16 .* \| ([+-]\d+\.\d) \|", -100.0, 1e4),
                     (rf"DeepSpeedStrategy\(stage=2\) \| {_N} \|", 0.0, 100.0)],
}
#: run by gpu_check.py (its smoke table shows each ran), or not a benchmark
COVERED = {"gpu_llama_mfu.py", "gpu_planner_check.py", "compile_blocks.py", "gpu_fp8.py", "gpu_lora_strategies.py",
           "smoke.py", "step_timer.py", "record.py"}


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts - COVERED == set(SMOKE), "add the new benchmark's --smoke run to SMOKE"
    assert set(FIGURES) == set(SMOKE), "name the new benchmark's figures and their plausible range in FIGURES"


class SmokeRuns:
    """Every script's --smoke run, one after the other in one process (``run_smoke.py``: torch, Lightning and DeepSpeed
    imported once for all), started once; each test waits for its own script's (exit code, output) only, so that the
    durations pytest reports are each script's."""

    def __init__(self, scripts: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("run_smoke.py")), *scripts],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.done: dict[str, tuple[int, str]] = {}
        self._ready = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        current, lines = None, []
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("=== start "):
                current, lines = line.split()[-1], []
            elif line.startswith("=== end ") and current is not None:
                with self._ready:
                    self.done[current] = (int(line.split()[-1]), "\n".join(lines))
                    self._ready.notify_all()
                current = None
            elif current is not None:
                lines.append(line)
        with self._ready:
            self._ready.notify_all()  # the process ended: a script without its end marker never comes

    def result(self, script: str, timeout: float = 600) -> tuple[int, str]:
        with self._ready:
            ended = self._ready.wait_for(lambda: script in self.done or self.proc.poll() is not None, timeout)
        assert ended and script in self.done, f"{script} did not finish its smoke run (exit {self.proc.poll()})"
        return self.done[script]


@pytest.fixture(scope="module")
def smoke_outputs():
    # gpu_check.py last: it trains in this process (one-process Trainers), the others fork their ranks from it
    scripts = [str(BENCHMARKS / name) for name in sorted(SMOKE, key=lambda name: (name == "gpu_check.py", name))]
    runs = SmokeRuns(scripts)
    yield runs
    runs.proc.kill()
    runs.proc.wait()


@pytest.mark.parametrize("script", sorted(SMOKE, key=lambda name: (name == "gpu_check.py", name)))
def test_benchmark_smoke_mode_runs_and_prints_its_figure(script, smoke_outputs):
    code, output = smoke_outputs.result(script)
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    marked = [i for i, line in enumerate(lines) if SMOKE[script] in line]
    assert marked, output[-3000:]
    assert_figures(script, output)
    if script == "gpu_check.py":  # every check ran and read its figure
        rows = [line for line in lines if line.startswith("| ") and "expectation" not in line and "---" not in line]
        assert len(rows) == 8 and all("ran (smoke)" in row or "not run" in row for row in rows), output  # 8: overlap


def assert_figures(script: str, output: str) -> None:
    """Every figure of :data:`FIGURES` is printed, finite and within its plausible range."""
    for pattern, low, high in FIGURES[script]:
        found = re.findall(pattern, output, re.MULTILINE)
        assert found, f"{script}: no figure matches {pattern!r}\n{output[-3000:]}"
        for match in found:
            for text in match if isinstance(match, tuple) else (match,):
                value = float(text.replace(",", ""))
                assert math.isfinite(value) and low < value < high, (script, pattern, text, (low, high))


def test_gpu_check_refuses_without_cuda_naming_what_is_missing(monkeypatch, capsys):
    """Its ``main()`` with every GPU hidden (``torch.cuda.is_available()`` False), so that it also runs (rather than
    skips) on a machine that has one; in this process, as ``python benchmarks/gpu_check.py`` runs it without ``--smoke``
    (the smoke runs above start the script itself)."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "gpu_check.py")])
    monkeypatch.delitem(sys.modules, "smoke", raising=False)  # it reads --smoke from sys.argv when imported
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script = runpy.run_path(str(BENCHMARKS / "gpu_check.py"))
    assert script["main"]() == 2
    out = capsys.readouterr().out
    assert "gpu-check needs CUDA" in out and "--smoke" in out, out
