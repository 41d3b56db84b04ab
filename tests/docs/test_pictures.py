"""The site's pictures (``docs/pictures/*.py``) in their smoke mode, into a temporary folder: each script still runs
against the package and writes its pictures, the data each was drawn from holds what it shows (the scripts check it:
every pipeline action once, every layout's loss on one process's, the chaos run's restarts), and the commands a
picture was recorded with still pass ``mgpu-train``'s checks. Every committed picture is on a page beside the
command that drew it."""

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

from pictures import rank_grid  # noqa: E402
from pictures.common import IMAGES  # noqa: E402

#: Every script of docs/pictures (each draws its PICTURES), a new one included.
SCRIPTS = [importlib.import_module(f"pictures.{p.stem}") for p in sorted((ROOT / "docs" / "pictures").glob("*.py"))
           if p.stem not in ("__init__", "common")]
PNG = b"\x89PNG\r\n\x1a\n"


def test_every_picture_is_drawn_by_its_script_in_smoke_mode(tmp_path):
    for script in SCRIPTS:
        written = script.main(["--smoke", "--out", str(tmp_path / script.__name__.split(".")[-1])])
        assert [p.name for p in written] == list(script.PICTURES), script.__name__
        for path in written:
            assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5_000, path


def test_rank_grid_draws_the_hand_worked_groups():
    """tp 2 x cp 2 x pp 2 x dp 2, rank r = tp + 2 cp + 4 pp + 8 dp: the groups the picture colours."""
    drawn = rank_grid.groups(rank_grid.layout())
    assert drawn["tp"] == [[r, r + 1] for r in range(0, 16, 2)]
    assert drawn["cp"] == [[r, r + 2] for base in (0, 4, 8, 12) for r in (base, base + 1)]
    assert drawn["pp"] == [[r, r + 4] for base in (0, 8) for r in range(base, base + 4)]
    assert drawn["dp"] == [[r, r + 8] for r in range(8)]
    assert drawn["dp_cp"] == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    assert drawn["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def sections(text: str) -> list[str]:
    """A page's sections: the text from one heading to the next."""
    return re.split(r"^#+ ", text, flags=re.MULTILINE)


def test_every_committed_picture_is_on_a_page_beside_its_command():
    """Each script's pictures are committed (small) and shown on a page, with the script's command in the same
    section; no picture is left without a script."""
    drawn = {name: script for script in SCRIPTS for name in script.PICTURES}
    assert {p.name for p in IMAGES.iterdir()} == set(drawn)
    shown = {name: [] for name in drawn}
    for page in (ROOT / "docs").rglob("*.md"):
        for section in sections(page.read_text()):
            for name in re.findall(r"\]\((?:\.\./)*images/([^)]+)\)", section):
                shown.setdefault(name, []).append((page.name, section))
    for name, script in drawn.items():
        assert (IMAGES / name).read_bytes()[:8] == PNG and (IMAGES / name).stat().st_size < 150_000, name
        command = f"python docs/pictures/{script.__name__.split('.')[-1]}.py"
        assert shown[name], f"{name} is on no page"
        for page, section in shown[name]:
            assert command in section, f"{page}: {name} without `{command}` in its section"
    assert set(shown) == set(drawn), "a page shows a picture that no script draws"
