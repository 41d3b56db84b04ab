"""mgpu-plan's whole run: the time, GPU-hours, energy and cost formulas against hand-computed numbers, the ranking for
a deadline, the scaling curve (its picture and its efficiency) and the refusals of bad whole-run settings."""

import math
import re

import pytest
from cli_helpers import composed, search_once_per_shape

from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.cli.plan_run import scaling_points
from lightning_mgpu.cli.rules import plan_problems
from lightning_mgpu.planner import GPUS, ClusterSpec, plan_layouts
from lightning_mgpu.planner.goodput import plan_goodput
from lightning_mgpu.planner.run_cost import (RunSettings, node_counts, rank_for_deadline, run_cost,
                                             scaling_efficiency)


@pytest.fixture(autouse=True)
def one_search_per_shape(monkeypatch):
    """The reports below differ in settings the planner's search does not read: one search per shape."""
    search_once_per_shape(monkeypatch, "lightning_mgpu.cli.plan.plan_layouts",
                          "lightning_mgpu.cli.plan_run.plan_layouts")


#: llama3_8b on 8-GPU nodes at the default data (sequence 128, global batch 16): a plan of well under a second.
SMALL = ("model=llama3_8b", "trainer.devices=8", "trainer.num_nodes=4")


def test_the_whole_run_formulas():
    # 1e9 tokens at 1e6 per 2 s step: 1,000 steps = 2,000 s failure-free; at 80% goodput 2,500 s of wall time
    s = RunSettings(tokens=1e9, price_per_gpu_hour=3.0, gpu_power_w=500.0, node_overhead_w=1000.0, pue=1.25)
    r = run_cost(tokens_per_step=1e6, step_s=2.0, goodput=0.8, nodes=2, gpus_per_node=4, settings=s)
    assert r.gpus == 8 and r.failure_free_hours == pytest.approx(2000 / 3600)
    assert r.hours == pytest.approx(2500 / 3600) and r.days == pytest.approx(2500 / 86400)
    assert r.gpu_hours == pytest.approx(8 * 2500 / 3600)  # 5.56 GPU-hours
    # 8 x 500 W + 2 x 1000 W = 6 kW for 0.694 h = 4.17 kWh, x 1.25 = 5.21 kWh
    assert r.energy_mwh == pytest.approx(6000 * 2500 / 3600 * 1.25 / 1e6)
    assert r.cost == pytest.approx(8 * 2500 / 3600 * 3.0)  # 16.67
    assert r.within(0.7) and not r.within(0.69)
    never = run_cost(1e6, 2.0, 0.0, 2, 4, s)  # a job that fails faster than it saves never finishes
    assert never.hours == math.inf and not never.within(1e9)
    unknown = run_cost(1e6, 2.0, 0.8, 2, 4, RunSettings(1e9, 3.0, None, 1000.0))
    assert unknown.energy_mwh is None and unknown.cost == pytest.approx(r.cost)


def test_the_deadline_ranks_the_runs_in_time_cheapest_first_and_names_the_fastest_when_none_is():
    s = RunSettings(tokens=3.6e9, price_per_gpu_hour=1.0, gpu_power_w=700.0, node_overhead_w=0.0)
    # (nodes, tokens/s of the whole job): 1 node 1e6/s = 1 h; 2 nodes 1.8e6/s = 0.56 h; 4 nodes 3e6/s = 0.33 h
    runs = {n: run_cost(rate, 1.0, 1.0, n, 8, s) for n, rate in ((1, 1e6), (2, 1.8e6), (4, 3e6))}
    assert [runs[n].cost for n in (1, 2, 4)] == pytest.approx([8.0, 8 * 2 / 1.8, 32 / 3])
    within, fastest = rank_for_deadline(list(runs), runs.get, deadline_hours=0.6)
    assert within == [2, 4] and fastest == 4  # 1 node misses 0.6 h; 2 nodes are cheaper than 4
    within, fastest = rank_for_deadline(list(runs), runs.get, deadline_hours=2.0)
    assert within == [1, 2, 4]
    within, fastest = rank_for_deadline(list(runs), runs.get, deadline_hours=0.1)
    assert within == [] and fastest == 4
    assert rank_for_deadline([], runs.get, 1.0) == ([], None)


def test_node_counts_and_efficiency():
    assert node_counts(16, 16) == [1, 2, 4, 8, 16]
    assert node_counts(12, 12) == [1, 2, 4, 8, 12]
    assert node_counts(4, 6) == [1, 2, 4, 6]  # the configured count is always a point
    assert node_counts(1, 1) == [1]
    assert scaling_efficiency([100.0, 90.0, 120.0]) == pytest.approx([1.0, 0.9, 1.2])


def test_mgpu_plan_prints_each_layouts_whole_run():
    cfg = composed(*SMALL, "plan.tokens=2e12", "plan.price_per_gpu_hour=2", "plan.top=3")
    report = plan_report(cfg)
    assert "whole run: 2T tokens (plan.tokens) = 976,562,500 steps of 2,048 tokens on 32 GPUs" in report
    assert "700 W per GPU (H100-SXM5-80GB's board power" in report and "2.00 per GPU-hour" in report
    model, _ = plan_problems(cfg)
    best = plan_layouts(model, ClusterSpec(4, 8, GPUS["h100_80gb"]), 128, 16)[0]
    save = 12 * model.num_parameters() / (4 * 2e9)  # a universal checkpoint written by 4 nodes at 2 GB/s each
    goodput = plan_goodput(32, 45_600, 1, best.time.total, save, 300).best_fraction  # Young/Daly: no every_n_steps
    hours = 2e12 / (2048 / best.time.total) / goodput / 3600
    mwh = hours * (32 * 700 + 4 * 2000) / 1e6
    row = _first_run_row(report)
    assert row.split("|")[-1].split() == [f"{hours / 24:,.1f}", f"{hours * 32:,.0f}", f"{mwh:,.1f}",
                                          f"{hours * 32 * 2:,.0f}"]
    assert "this configuration's run:" in report and "deadline" not in report and "scaling" not in report


def _first_run_row(report: str) -> str:
    lines = report.split("\n")
    head = next(i for i, line in enumerate(lines) if "GPU-hours" in line)
    return lines[head + 1]


#: A scaling table's row: nodes, GPUs, tokens/s per GPU, efficiency, goodput %, and (with plan.tokens) days,
#: GPU-hours, MWh and cost.
SCALING_ROW = re.compile(r"^ +(\d+) +(\d+) \|[^|]*\| +[\d.]+ +(\d+) +([\d.]+) +([\d.]+)% *"
                         r"(?:\| +([\d.,]+) +([\d,]+) +[\d.,]+ +([\d,]+))?$", flags=re.M)


def scaling_rows(report: str) -> list[dict]:
    rows = [[float(v.replace(",", "")) if v else None for v in m] for m in SCALING_ROW.findall(report)]
    keys = ("nodes", "gpus", "tps_per_gpu", "efficiency", "goodput", "days", "gpu_hours", "cost")
    return [dict(zip(keys, row)) for row in rows]


def test_the_deadline_lists_node_counts_in_time_cheapest_first():
    """Worked from the printed table alone: a run of 1e11 tokens takes 1e11 / (tokens/s per GPU x GPUs) / goodput
    seconds, costs its GPU-hours at 2.5 each, and is in time when that is at most 300 h."""
    report = plan_report(composed(*SMALL, "plan.tokens=1e11", "plan.deadline_hours=300"))
    rows = scaling_rows(report)
    assert [r["nodes"] for r in rows] == [1, 2, 4] and [r["gpus"] for r in rows] == [8, 16, 32]
    hours = {}
    for r in rows:
        hours[r["nodes"]] = 1e11 / (r["tps_per_gpu"] * r["gpus"]) / (r["goodput"] / 100) / 3600
        # printed to 0.1 day, from tokens/s printed to 4 digits: the two roundings add up
        assert abs(r["days"] - hours[r["nodes"]] / 24) <= 0.051 + 2e-3 * hours[r["nodes"]] / 24
        assert r["cost"] == pytest.approx(hours[r["nodes"]] * r["gpus"] * 2.5, rel=2e-3)
    in_time = sorted((n for n in hours if hours[n] <= 300), key=lambda n: hours[n] * n)  # cost ~ GPU-hours
    assert 0 < len(in_time) < len(rows)  # the deadline splits the node counts
    listed = re.findall(r"^ +(\d+) nodes: ([\d,]+) h .* cost ([\d,]+);", report, flags=re.M)
    assert [int(n) for n, _, _ in listed] == in_time
    for n, h, _ in listed:
        assert float(h.replace(",", "")) == pytest.approx(hours[int(n)], rel=2e-3, abs=0.51)
    assert f"the cheapest in time, as overrides: trainer.num_nodes={int(in_time[0])} " in report

    none = plan_report(composed(*SMALL, "plan.tokens=1e11", "plan.deadline_hours=1"))
    fastest = min(hours, key=hours.get)
    assert ("deadline 1 h (plan.deadline_hours): NO layout at 1 to 4 nodes finishes 100B tokens in time; the "
            f"fastest: {int(fastest)} nodes") in none


def test_the_scaling_curve_is_drawn_and_its_efficiency_starts_at_one(tmp_path):
    picture = tmp_path / "curve.png"
    cfg = composed(*SMALL, f"plan.scaling_curve={picture}")
    report = plan_report(cfg)
    assert picture.stat().st_size > 10_000 and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"scaling curve drawn: {picture}" in report
    model, _ = plan_problems(cfg)
    points = scaling_points(cfg, model, ClusterSpec(4, 8, GPUS["h100_80gb"]), "bf16-mixed", None)
    assert [p.nodes for p in points] == [1, 2, 4] and all(p.run is None for p in points)
    assert points[0].efficiency == 1.0
    first = points[0].row.time.tokens_per_second_per_gpu
    for p in points:
        assert p.efficiency == pytest.approx(p.row.time.tokens_per_second_per_gpu / first)
        assert p.row.time.total == min(r.time.total for r in plan_layouts(
            model, ClusterSpec(p.nodes, 8, GPUS["h100_80gb"]), 128, 16) if r.fits)  # Young/Daly: the fastest
    rows = scaling_rows(report)
    assert [(r["nodes"], r["gpus"]) for r in rows] == [(1, 8), (2, 16), (4, 32)] and rows[0]["efficiency"] == 1.0
    for r in rows:  # by hand from the printed columns: tokens/s per GPU over the first row's
        assert r["efficiency"] == pytest.approx(r["tps_per_gpu"] / rows[0]["tps_per_gpu"], abs=0.0051)


def test_bad_whole_run_settings_are_refused_all_at_once():
    cfg = composed(*SMALL, "plan.tokens=0", "plan.deadline_hours=-5", "plan.price_per_gpu_hour=-1", "plan.pue=0.9",
                   "plan.node_overhead_w=-10", "plan.gpu_power_w=0", "plan.max_nodes=0",
                   "plan.scaling_curve=/no/such/folder/curve.jpg")
    with pytest.raises(ConfigError) as err:
        plan_report(cfg)
    problems = err.value.problems
    for expected in ("plan.tokens=0 must be a finite number > 0 (the run's token budget); set e.g. plan.tokens=2e12",
                     "plan.deadline_hours=-5 must be a finite number > 0", "plan.price_per_gpu_hour=-1 must be a "
                     "finite number >= 0", "plan.pue=0.9 must be a finite number >= 1", "plan.node_overhead_w=-10 "
                     "must be a finite number >= 0", "plan.gpu_power_w=0 must be a finite number > 0",
                     "plan.max_nodes=0 must be an integer >= 1", "plan.scaling_curve='/no/such/folder/curve.jpg' "
                     "must name a picture file ending in .png", "is in a folder that does not exist"):
        assert any(expected in p for p in problems), (expected, problems)
    assert len(problems) == 9
    with pytest.raises(ConfigError, match=r"plan.deadline_hours=720 needs the token budget it is a deadline for; "
                                          r"set plan.tokens"):
        plan_report(composed(*SMALL, "plan.deadline_hours=720"))
    with pytest.raises(ConfigError, match=r"parallel.replica_update='local' plans one replica's layout, while "
                                          r"plan.tokens plans one job"):
        plan_report(composed("recipe=llama3_8b_2site", "plan.tokens=1e12"))
