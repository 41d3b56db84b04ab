"""The measurements page is generated: ``docs/measurements.md`` equals what ``benchmarks/record.py`` assembles from the
fragments in ``docs/measurements/``, every fragment states its command, commit, machine and date, and a benchmark run
with ``--smoke`` writes no fragment where its full run writes one holding what it printed."""

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
FRAGMENTS = ROOT / "docs" / "measurements"
REQUIRED = ("title", "command", "commit", "machine", "date")


@pytest.fixture()
def record(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import record

    return record


def header(text: str) -> dict[str, str]:
    """A fragment's header keys and values, read here rather than by the module under test."""
    block = text.split("---\n")[1] if text.startswith("---\n") else ""
    return dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)


def test_the_page_is_what_the_fragments_give(record):
    assert (ROOT / "docs" / "measurements.md").read_text() == record.render(FRAGMENTS), (
        "docs/measurements.md was edited by hand or a fragment changed: run `make measurements-page` and commit both")


def test_every_fragment_states_its_command_commit_machine_and_date(record):
    paths = sorted(FRAGMENTS.glob("*.md"))
    assert {p.stem for p in paths} <= set(record.ORDER), "a fragment the page leaves out: add it to ORDER"
    for path in paths:
        fields = header(path.read_text())
        assert all(fields.get(key, "").strip() for key in REQUIRED), (path.name, fields)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", fields["date"]), (path.name, fields["date"])
        assert re.match(r"[0-9a-f]{7,40}\b|not recorded", fields["commit"]), (path.name, fields["commit"])


def test_a_fragment_without_its_provenance_is_refused_naming_every_gap(record, tmp_path):
    for name in record.ORDER:
        if name not in record.GPU_ONLY:
            (tmp_path / f"{name}.md").write_text(
                "---\ntitle: t\ncommand: c\ncommit: abcdef1\nmachine: m\ndate: 2026-12-06\n---\n\ntext\n")
    (tmp_path / "overhead.md").write_text("---\ntitle: t\ncommand: c\nmachine: m\n---\n\ntext\n")
    (tmp_path / "stray.md").write_text("---\ntitle: t\ncommand: c\ncommit: abcdef1\nmachine: m\ndate: 6 Dec\n---\n")
    with pytest.raises(ValueError) as refused:
        record.render(tmp_path)
    message = str(refused.value)
    assert "overhead.md: no commit, date" in message and "stray.md: not in ORDER" in message, message


def test_a_smoke_run_writes_no_fragment_and_a_full_run_writes_what_it_printed(record, tmp_path, monkeypatch, capsys):
    script = str(BENCHMARKS / "planner_calibration.py")
    monkeypatch.setenv("MGPU_MEASUREMENTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [script, "--smoke"])
    runpy.run_path(script, run_name="__main__")
    assert list(tmp_path.iterdir()) == []
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [script])
    runpy.run_path(script, run_name="__main__")
    printed = capsys.readouterr().out
    text = (tmp_path / "planner_calibration.md").read_text()
    fields = header(text)
    assert fields["command"] == "python benchmarks/planner_calibration.py" and fields["title"], fields
    assert all(fields.get(key) for key in REQUIRED), fields
    rows = [line for line in printed.splitlines() if line.startswith("| MPT-")]
    assert len(rows) > 10 and all(row in text for row in rows)


#: benchmarks whose sections were carried over from the hand-written page and whose scripts do not record yet
NOT_YET_RECORDING: set[str] = set()


def test_every_benchmark_that_owns_a_section_writes_it(record):
    owners = {name for name in record.ORDER if (BENCHMARKS / f"{name}.py").exists()}
    silent = {name for name in owners if "recorded(" not in (BENCHMARKS / f"{name}.py").read_text()}
    assert silent == NOT_YET_RECORDING, (
        f"{sorted(silent - NOT_YET_RECORDING)} own a section but do not write it: run main() inside record.recorded; "
        f"{sorted(NOT_YET_RECORDING - silent)} record now: take them out of NOT_YET_RECORDING")


def test_make_measurements_runs_every_cpu_benchmark_that_writes_a_section():
    makefile = (ROOT / "Makefile").read_text()
    listed = set(re.search(r"^CPU_BENCHMARKS :=((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\\n", " ").split())
    writers = {p.stem for p in BENCHMARKS.glob("*.py") if "with recorded(" in p.read_text() and p.stem != "gpu_check"}
    assert writers <= listed, f"add {sorted(writers - listed)} to CPU_BENCHMARKS in the Makefile"
