"""Print the planner's step time against published training runs (``lightning_mgpu.planner.calibration``): the
fitting set, the held-out set (runs no constant was chosen from) and the runs left out with the reason; beside each
prediction the bound with no overlap at all; then each set's mean absolute error and worst run. ``--fit`` also
refits the compute fractions on the fitting set and prints them beside the ones in ``planner/hardware.py``."""

import sys

from lightning_mgpu.planner.calibration import calibration_table, fit_constants, held_out_summary
from lightning_mgpu.planner.hardware import GPUS

# --smoke (what make test runs) prints the same tables: they take well under a second.

if __name__ == "__main__":
    for role, title in (("fit", "Fitting set"), ("held_out", "Held-out set"), ("left_out", "Left out")):
        print(f"## {title}\n\n{calibration_table(role=role)}\n")
    print(held_out_summary())
    if "--fit" in sys.argv:
        fitted = fit_constants()
        print(f"fitted on the fitting set: {fitted}")
        print("in planner/hardware.py: " + ", ".join(
            f"{key} ({spec.achievable}, {spec.attention_achievable}, {spec.saturation_tokens:.0f})"
            for key, spec in GPUS.items()))
