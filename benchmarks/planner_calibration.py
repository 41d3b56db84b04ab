"""The planner's step time against published bf16 training runs (``lightning_mgpu.planner.calibration``), each with its
source in ``lightning_mgpu/planner/published_runs.py``: the fitting set, the held-out set (runs no constant was chosen
from) and the runs left out with the reason; beside each prediction, *no overlap*: the planner's tokens/s per GPU if
no communication ran behind compute; then each set's mean absolute error and worst run. Nothing here runs on a GPU:
the measured figures are the published ones. The compute constants were fitted on the fitting set alone (``--fit``
refits them and prints them beside the ones in ``planner/hardware.py``). The model's terms and where the held-out
error is largest: [Planning a layout](how-to/plan.md#step-time-calibrated); ``tests/unit/test_planner_heldout.py``
holds the held-out set at or below 15% on average and every run within +-30%.

Usage: python benchmarks/planner_calibration.py [--fit]
"""

import sys

from lightning_mgpu.planner.calibration import calibration_table, fit_constants, held_out_summary
from lightning_mgpu.planner.hardware import GPUS
from record import recorded

# --smoke (what make test runs) prints the same tables: they take well under a second.


def main() -> None:
    for role, title in (("fit", "Fitting set"), ("held_out", "Held-out set"), ("left_out", "Left out")):
        print(f"## {title}\n\n{calibration_table(role=role)}\n")
    print(held_out_summary())
    if "--fit" in sys.argv:
        fitted = fit_constants()
        print(f"fitted on the fitting set: {fitted}")
        print("in planner/hardware.py: " + ", ".join(
            f"{key} ({spec.achievable}, {spec.attention_achievable}, {spec.saturation_tokens:.0f})"
            for key, spec in GPUS.items()))


if __name__ == "__main__":
    with recorded(__file__, "Planner step time, fitted and held out", about=__doc__, markdown=True):
        main()
