"""The training loss of ``make train`` (the tiny model, 300 steps on the built-in corpus) on one process and on six
layouts of several processes, each as ``mgpu-train`` logs it (``train/loss`` in the run's ``metrics.csv``, the CSV
logger being the default); the curves are kept in ``docs/pictures/data/loss-curves.json``.

    python docs/pictures/loss_curves.py                       # runs mgpu-train once per layout (5-10 minutes)
    python docs/pictures/loss_curves.py --smoke --out DIR     # draws the kept curves into DIR, no run
"""

from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pictures.common import check_commands, expect, mgpu_train, options, read_data, save, write_data  # noqa: E402

PICTURES = ("loss-curves.png",)
DATA_FILE = "loss-curves.json"
STEPS = 300
#: label -> overrides, the first the reference (one process); every run also has trainer.max_steps=STEPS
LAYOUTS = {
    "one process": ["trainer.devices=1"],
    "dp 2, ZeRO-2 (the default)": [],
    "dp 2, ZeRO-3": ["parallel.zero_stage=3"],
    "tp 2, sequence parallel": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"],
    "cp 2": ["parallel.context_parallel_size=2"],
    "pp 2, 1F1B": ["parallel.pipeline_parallel_size=2"],
    "tp 2 x pp 2 (4 processes)": ["trainer.devices=4", "parallel.tensor_parallel_size=2",
                                  "parallel.pipeline_parallel_size=2"],
}
#: What the picture claims: every layout's loss is one process's to 1e-5 (the parity tests' tolerance) for the first
#: PARITY_STEPS steps, and on its curve after that, float rounding grown by training within TOLERANCE.
PARITY_STEPS, TOLERANCE = 30, 0.03


def overrides(label: str) -> list[str]:
    return [*LAYOUTS[label], f"trainer.max_steps={STEPS}", "trainer.enable_progress_bar=false"]


def logged_losses(metrics: Path) -> list[float]:
    """``train/loss`` of every step of a run's ``metrics.csv``, in step order."""
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    by_step = {int(r["step"]): float(r["train/loss"]) for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def record() -> None:
    curves = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, label in enumerate(LAYOUTS):
            run_dir = mgpu_train(overrides(label), Path(tmp) / f"run{i}")
            curves.append({"label": label, "overrides": overrides(label),
                           "losses": logged_losses(run_dir / "metrics.csv")})
    write_data(DATA_FILE, {"steps": STEPS, "curves": curves})


def differences(data: dict) -> dict[str, list[float]]:
    """Each layout's |loss - the one process's loss|, step by step; checks that every curve has every step, and the
    differences :data:`PARITY_STEPS` and :data:`TOLERANCE` allow."""
    expect([(c["label"], c["overrides"]) for c in data["curves"]] == [(k, overrides(k)) for k in LAYOUTS],
           "the kept curves were recorded with other commands: record them again")
    reference, *others = data["curves"]
    out = {}
    for curve in others:
        expect(len(curve["losses"]) == len(reference["losses"]) == data["steps"], (curve["label"], data["steps"]))
        out[curve["label"]] = [abs(a - b) for a, b in zip(curve["losses"], reference["losses"])]
    early = max(max(d[:PARITY_STEPS]) for d in out.values())
    expect(early <= 1e-5, f"a layout's loss is {early:.2e} from one process's in the first {PARITY_STEPS} steps")
    worst = max(max(d) for d in out.values())
    expect(worst <= TOLERANCE, f"a layout's loss is {worst:.2e} from one process's")
    return out


def draw(data: dict, path: Path) -> Path:
    from matplotlib.figure import Figure

    reference, *others = data["curves"]
    diffs = differences(data)
    steps = range(1, data["steps"] + 1)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    loss_ax, diff_ax = fig.subplots(1, 2)
    loss_ax.plot(steps, reference["losses"], color="black", linewidth=5, alpha=0.25, label=reference["label"])
    for curve in others:
        loss_ax.plot(steps, curve["losses"], linewidth=0.8, label=curve["label"])
        diff_ax.plot(steps, [max(d, 1e-9) for d in diffs[curve["label"]]], linewidth=0.8, label=curve["label"])
    loss_ax.set(xlabel="step", ylabel="train/loss", title="the loss each run logged")
    diff_ax.set(xlabel="step", ylabel="|loss - one process's loss| (floor 1e-9)", yscale="log",
                title=f"its difference from one process (largest {max(max(d) for d in diffs.values()):.1e})")
    loss_ax.legend(fontsize=7)
    for ax in (loss_ax, diff_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(f"make train's run (tiny model, {data['steps']} steps, fp32, CPU) on seven layouts", fontsize=10)
    return save(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    if opts.smoke:
        check_commands([overrides(label) for label in LAYOUTS])
    else:
        record()
    return [draw(read_data(DATA_FILE), opts.out / PICTURES[0])]


if __name__ == "__main__":
    main()
