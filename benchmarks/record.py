"""The measurements page, generated: each benchmark run in full writes its own section (a *fragment*,
``docs/measurements/<benchmark>.md``) through :func:`recorded`, and ``python benchmarks/record.py`` (``make
measurements-page``) assembles ``docs/measurements.md`` from the fragments in the order of :data:`ORDER`.

A fragment is a short header between ``---`` lines (``title``, one ``command`` line per command, ``commit``,
``machine``, ``date``, and an optional ``anchor`` that keeps a link's target) and the section's text. A benchmark's
fragment holds what the script printed in that run, under its docstring's description, so the page quotes no figure
that a script did not print. Written by hand rather than with a documentation plugin (mkdocs-gen-files runs scripts at
build time, which would need every benchmark's output at hand): the renderer is a few string joins and its output is
committed, so that a test can hold the page equal to it.

``--check`` exits 1 where ``docs/measurements.md`` is not what the fragments give (``tests/unit`` asserts the same).
A ``--smoke`` run writes nothing: its figures measure nothing.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional, TextIO

ROOT = Path(__file__).resolve().parents[1]
#: Where fragments are written; ``MGPU_MEASUREMENTS_DIR`` moves them (the tests write to a temporary directory).
FRAGMENTS = ROOT / "docs" / "measurements"
PAGE = ROOT / "docs" / "measurements.md"
REQUIRED = ("title", "command", "commit", "machine", "date")

#: The page's sections, in order (each a fragment's file name without ``.md``). A new benchmark adds its name here.
ORDER = (
    # step time and overheads
    "overhead", "tp_vs_dtensor", "hf_step_time", "tp_vs_hf_tp", "vs_deepspeed_strategy", "comm_volume", "comm_count",
    "compile_blocks", "document_mask", "action_labels",
    # memory
    "setup_memory", "memory_factors", "selective_checkpointing",
    # parallelism
    "context_parallel", "pipeline_bubble", "pipeline_in_flight", "pipeline_overlap", "moe_throughput", "hf_moe_parity",
    "hf_moe_ep", "replica_updates",
    # the planner
    "planner_calibration", "whole_run_plan", "dry_run_405b", "dry_run_moe", "hf_moe_dry_run",
    # precision and optimizers
    "muon_step", "muon_quality", "fp8_curve", "fp8_steps", "fp8_vs_bf16", "bf16_zero0",
    # transformers models and fine-tuning
    "hf_families", "lora_memory", "lora_checkpoints", "lora_step",
    # data
    "prepare_throughput", "sft_data", "sft_step_time",
    # failures and checkpoints
    "fault_matrix", "resilience_cost", "fingerprint_step", "chaos_goodput", "restart_buckets", "restarts_elastic",
    "async_checkpoint", "checkpoint_verify", "hang_reports", "lost_rank", "preemption", "faulty_host", "forked_ranks",
    # one GPU
    "gpu_check",
    # the docs' pictures and the code itself
    "pictures", "package_structure",
)
#: Sections that only a GPU run writes: until it has, the page says so and names the command that fills it.
GPU_ONLY = {"gpu_check": ("One GPU: `make gpu-check`",
                          "Not measured yet: no CUDA GPU has run it. `make gpu-check` on one CUDA GPU writes this "
                          "section: the CUDA tests, bf16 MFU of `llama3_1b`, the planner's peak memory and step time "
                          "against measurement, compile's speed-up of the blocks, fp8 against bf16, and a LoRA step "
                          "under `MGPUStrategy(zero_stage=2)` against Lightning's `DeepSpeedStrategy(stage=2)`.")}
INTRO = """# Measurements

One section per claim: the figures, the command that reproduces them, the commit they were measured at, the machine
and the date. This page is generated (`make measurements-page`, `python benchmarks/record.py`) from the fragments in
`docs/measurements/`, which each benchmark rewrites when it runs in full (`make measurements` runs the CPU set, hours on
2 cores); do not edit it by hand. Where a section's commit or machine was not recorded when it was measured, it says
so. On 2 shared CPU cores a timing moves with the load: a section gives the load where it was read, and a ratio measured
on busy cores is not a quiet machine's. Nothing here ran on a GPU unless its machine says so: the GPU figures of the
planner's calibration are published runs.
"""


@dataclass(frozen=True)
class Fragment:
    """One section: its header fields (``command`` may hold several lines) and its markdown text."""

    name: str
    fields: dict[str, str]
    body: str


def parse(name: str, text: str) -> tuple[Fragment, list[str]]:
    """A fragment and the problems with its header (every one, each naming the fragment, the rule and the fix)."""
    problems, fields = [], {}
    match = re.match(r"---\n(.*?)\n---\n", text, re.S)
    if not match:
        return Fragment(name, {}, text), [f"{name}.md: no header; start it with '---', 'key: value' lines and '---'"]
    for line in match.group(1).splitlines():
        key, sep, value = line.partition(": ")
        if not sep or not value.strip():
            problems.append(f"{name}.md: header line {line!r} is not 'key: value'")
        elif key == "command" and key in fields:
            fields[key] += "\n" + value.strip()
        else:
            fields[key] = value.strip()
    missing = [key for key in REQUIRED if key not in fields]
    if missing:
        problems.append(f"{name}.md: no {', '.join(missing)}; every section states {', '.join(REQUIRED)} "
                        "(write 'not recorded' where it was not)")
    if "date" in fields and not re.fullmatch(r"\d{4}-\d{2}-\d{2}|not recorded", fields["date"]):
        problems.append(f"{name}.md: date {fields['date']!r} is not YYYY-MM-DD")
    if "commit" in fields and not re.match(r"[0-9a-f]{7,40}\b|not recorded", fields["commit"]):
        problems.append(f"{name}.md: commit {fields['commit']!r} does not start with a commit hash or 'not recorded'")
    return Fragment(name, fields, text[match.end():].strip("\n")), problems


def read_fragments(directory: Path) -> tuple[list[Fragment], list[str]]:
    """The fragments of :data:`ORDER` in order, and every problem: a header's, a file :data:`ORDER` does not name, a
    name of :data:`ORDER` without its file (unless a GPU run has yet to write it)."""
    present = {path.stem: path for path in directory.glob("*.md")}
    problems = [f"{name}.md: not in ORDER of benchmarks/record.py; add its name where its section belongs"
                for name in sorted(set(present) - set(ORDER))]
    fragments = []
    for name in ORDER:
        if name in present:
            fragment, found = parse(name, present[name].read_text())
            fragments.append(fragment)
            problems += found
        elif name not in GPU_ONLY:
            problems.append(f"{name}: named in ORDER but {directory / (name + '.md')} does not exist; run its "
                            "benchmark in full or remove the name")
    return fragments, problems


def render_section(fragment: Fragment) -> str:
    """A section: its title, where it came from, then its text."""
    f = fragment.fields
    anchor = f" {{#{f['anchor']}}}" if "anchor" in f else ""
    commands = f["command"].splitlines()
    command = (f"Command: `{commands[0]}`" if len(commands) == 1 else
               "Commands:\n\n  ```\n" + "\n".join(f"  {c}" for c in commands) + "\n  ```")
    return (f"## {f['title']}{anchor}\n\n- {command}\n- Commit: {f['commit']}\n- Machine: {f['machine']}\n"
            f"- Date: {f['date']}\n\n{fragment.body}\n")


def render(directory: Path = FRAGMENTS) -> str:
    """The whole page from the fragments; a ValueError lists every problem with them."""
    fragments, problems = read_fragments(directory)
    if problems:
        raise ValueError("The measurements' fragments have problems:\n- " + "\n- ".join(problems))
    by_name = {fragment.name: fragment for fragment in fragments}
    sections = []
    for name in ORDER:
        if name in by_name:
            sections.append(render_section(by_name[name]))
        else:
            title, text = GPU_ONLY[name]
            sections.append(f"## {title}\n\n{text}\n")
    return INTRO + "\n" + "\n".join(sections)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_line() -> str:
    """The short commit, and whether the package or the benchmarks differed from it when they ran."""
    commit = _git("rev-parse", "--short", "HEAD") or "not recorded (no git)"
    changed = [line[3:] for line in _git("status", "--porcelain", "--", "lightning_mgpu", "benchmarks").splitlines()]
    if not changed:
        return commit
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"{commit} with uncommitted changes to {', '.join(changed[:3])}{more}"


def machine_line() -> str:
    """The CPU, its cores, the GPU if any, torch, and the load average when the run ended (the cores may be shared)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    gpu, torch_version = "no GPU", "torch not imported"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch_version = f"torch {torch.__version__}"
        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, {platform.system()}, {torch_version}, load average {load:.1f}"


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.copy = out, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def description(doc: Optional[str]) -> str:
    """A docstring as markdown: up to its usage line, ``code`` as `code`."""
    text = re.split(r"\n\s*Usage:", doc or "")[0].strip()
    return re.sub(r"``(.+?)``", r"`\1`", text)


def fragment_text(title: str, command: str, about: str, output: str, markdown: bool,
                  anchor: Optional[str] = None) -> str:
    """A fragment's file: header, description and the run's output (its headings under the section's)."""
    output = output.strip("\n")
    if markdown:
        output = re.sub(r"^(#{1,3}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", output, flags=re.M)
    else:
        output = "```\n" + output + "\n```"
    date = datetime.now(timezone.utc).date().isoformat()
    header = (f"---\ntitle: {title}\n" + (f"anchor: {anchor}\n" if anchor else "") + f"command: {command}\n"
              f"commit: {commit_line()}\nmachine: {machine_line()}\ndate: {date}\n---\n\n")
    return header + (about + "\n\n" if about else "") + output.strip("\n") + "\n"


@contextlib.contextmanager
def recorded(script: str, title: str, about: Optional[str] = None, markdown: bool = False,
             when: bool = True, name: Optional[str] = None) -> Iterator[None]:
    """Run the body (a benchmark's ``main()``), print as usual, and write what it printed as the section ``title`` of
    ``docs/measurements/<script's name>.md``, if it ends without an error (``sys.exit(0)`` counts as one) and was not
    a ``--smoke`` run. ``markdown``: the output is markdown (tables) rather than text to show as it is. ``when``:
    False for a variant of the run that is not the section's (one case of it, another device), which writes nothing.
    ``name``: the fragment's name where a script writes more than one section (else the script's name)."""
    if "--smoke" in sys.argv[1:] or not when:
        yield
        return
    tee, stdout = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        yield
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
        _write(script, title, about, tee.copy.getvalue(), markdown, name)
        raise
    finally:
        sys.stdout = stdout
    _write(script, title, about, tee.copy.getvalue(), markdown, name)


def _write(script: str, title: str, about: Optional[str], output: str, markdown: bool,
           name: Optional[str] = None) -> None:
    path = Path(script).resolve()
    command = " ".join(["python", os.path.relpath(path, ROOT), *sys.argv[1:]])
    directory = Path(os.environ.get("MGPU_MEASUREMENTS_DIR", FRAGMENTS))
    directory.mkdir(parents=True, exist_ok=True)
    name = name or path.stem
    target = directory / f"{name}.md"
    # the section's link target as the other pages know it, kept from the fragment this run replaces
    anchor = parse(name, target.read_text())[0].fields.get("anchor") if target.exists() else None
    text = fragment_text(title, command, description(about), output, markdown, anchor)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, target)
    print(f"recorded {target}", file=sys.stderr)


def main() -> int:
    """Write ``docs/measurements.md`` from the fragments, or with ``--check`` say whether it is what they give."""
    page = render(Path(os.environ.get("MGPU_MEASUREMENTS_DIR", FRAGMENTS)))
    if "--check" in sys.argv[1:]:
        if PAGE.read_text() != page:
            print(f"{PAGE} is not what the fragments give: run `make measurements-page` and commit it")
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
