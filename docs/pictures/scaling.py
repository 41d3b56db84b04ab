"""The planner's scaling curve, as ``mgpu-plan ... plan.scaling_curve=PATH`` draws it
(``lightning_mgpu.cli.plan_run.draw_scaling_curve``): the 70B recipe on 1 to 64 nodes of 8 H100s. ``mgpu-plan`` runs
in this process (its ``main``, as the console script runs it); no GPU is needed, every figure is the planner's.

    python docs/pictures/scaling.py                       # docs/images/scaling.png (about 15 s)
    python docs/pictures/scaling.py --smoke --out DIR     # a 1B model on 1 to 2 nodes, into DIR (about 1 s)
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pictures.common import clear_hydra, expect, options  # noqa: E402

PICTURES = ("scaling.png",)
#: The command of "Planning a whole run" (docs/how-to/plan.md), which draws the picture.
COMMAND = ["recipe=llama3_70b_8node", "plan.tokens=1e12", "plan.deadline_hours=1200", "plan.max_nodes=64"]
SMOKE = ["model=llama3_1b", "trainer.devices=8", "trainer.num_nodes=1", "plan.max_nodes=2", "plan.top=1"]


def plan(overrides: Sequence[str], path: Path) -> str:
    """``mgpu-plan OVERRIDES plan.scaling_curve=PATH``: its printed report."""
    from lightning_mgpu.cli.plan import main as mgpu_plan

    arguments = [*overrides, f"plan.scaling_curve={path}"]
    print("mgpu-plan " + " ".join(arguments), flush=True)
    report = io.StringIO()
    clear_hydra()
    with contextlib.redirect_stdout(report):
        mgpu_plan(arguments)
    expect(f"scaling curve drawn: {path}" in report.getvalue(), report.getvalue()[-3000:])
    return report.getvalue()


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    path = opts.out / PICTURES[0]
    report = plan(SMOKE if opts.smoke else COMMAND, path)
    print("\n".join(line for line in report.splitlines() if re.match(r"\s*\d+\s+\d+ \| ", line)))  # the scaling rows
    print(f"drew {path}", flush=True)
    return [path]


if __name__ == "__main__":
    main()
