"""What the picture scripts share: their command line, where pictures and their data go, running ``mgpu-train`` and
checking the commands a picture was recorded with."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
#: The committed pictures, as the pages link them (``../images/NAME.png``).
IMAGES = ROOT / "docs" / "images"
#: What the pictures of long runs were drawn from, kept so that the smoke mode redraws them without the runs.
DATA = Path(__file__).resolve().parent / "data"
BIN = Path(sys.executable).parent
#: Resolution of the pictures these scripts draw themselves (the package's own charts keep theirs).
DPI = 100


@dataclass(frozen=True)
class Options:
    smoke: bool
    out: Path


def options(argv: Optional[Sequence[str]], description: str) -> Options:
    """``--smoke`` and ``--out DIR`` (the pictures' folder: ``docs/images`` by default; the smoke mode needs one, so
    that it never writes over the committed pictures)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="draw cheaply into --out: from the data kept in docs/pictures/data, no long run")
    parser.add_argument("--out", type=Path, default=None, help="folder of the pictures (default: docs/images)")
    args = parser.parse_args(argv)
    if args.smoke and args.out is None:
        parser.error("--smoke draws into --out DIR, never over the committed pictures")
    out = (args.out or IMAGES).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return Options(args.smoke, out)


def mgpu_train(overrides: Sequence[str], run_dir: Path, timeout: float = 3600) -> Path:
    """Run ``mgpu-train OVERRIDES`` (the installed console script, a fresh interpreter) into ``run_dir``; stop with its
    output if it fails."""
    print("mgpu-train " + " ".join(overrides), flush=True)
    command = [str(BIN / "mgpu-train"), *overrides, f"hydra.run.dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"mgpu-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return run_dir


def check_commands(commands: Sequence[Sequence[str]]) -> None:
    """Every ``mgpu-train`` command a picture was recorded with still composes and passes the config's own checks
    (the smoke mode's stand-in for running it)."""
    from hydra import compose, initialize_config_dir

    from lightning_mgpu.cli.config import register_configs
    from lightning_mgpu.cli.paths import conf_dir
    from lightning_mgpu.cli.spec import config_problems

    # as lightning_mgpu.cli.plan.compose_plan_config composes one, with the schema and recipes registered once for all
    # (registering builds every recipe's config again: half of each composition's time)
    clear_hydra()
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        for overrides in commands:
            problems = config_problems(compose("config", overrides=list(overrides)))
            if problems:
                raise SystemExit("mgpu-train " + " ".join(overrides) + " is refused:\n  " + "\n  ".join(problems))


def clear_hydra() -> None:
    """Forget a Hydra initialisation this process made before (composing again would be refused)."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()


def expect(holds: bool, message: object) -> None:
    """Stop with ``message`` unless ``holds``: what a picture shows that its data does not."""
    if not holds:
        raise AssertionError(message)


def read_data(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def write_data(name: str, value: Any) -> Path:
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / name
    path.write_text(json.dumps(value, indent=1) + "\n")
    return path


def save(fig, path: Path) -> Path:
    """Write a matplotlib ``Figure`` (Agg canvas, no display) at :data:`DPI`, in 128 colours (a third of the bytes of
    full colour, no visible change for flat charts)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    Image.open(buffer).convert("RGB").quantize(128).save(path, optimize=True)
    print(f"drew {path}", flush=True)
    return path
