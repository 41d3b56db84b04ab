"""The planner's goodput under failures (Young/Daly) against hand-computed numbers, and mgpu-plan's lines."""

import math

import pytest
from cli_helpers import composed, search_once_per_shape

from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.planner.goodput import LLAMA3_GPU_MTBF_HOURS, goodput_fraction, plan_goodput, save_seconds


@pytest.fixture(autouse=True)
def one_search_per_shape(monkeypatch):
    """The reports below differ in settings the planner's search does not read: one search per shape."""
    search_once_per_shape(monkeypatch, "lightning_mgpu.cli.plan.plan_layouts")


def test_the_goodput_formula_and_the_young_daly_interval():
    # 1,000 GPUs of 10,000 h: the job fails every 10 h = 36,000 s; saves of 20 s every 100 steps of 6 s (600 s)
    g = plan_goodput(1000, 10_000, every_n_steps=100, step_s=6.0, save_s=20.0, restart_s=300.0)
    assert g.job_mtbf_s == 36_000 and g.interval_s == 600
    assert g.fraction == pytest.approx(1 - 20 / 600 - (300 + 300) / 36_000)
    assert g.best_interval_s == pytest.approx(math.sqrt(2 * 20 * 36_000)) == pytest.approx(1200)
    assert g.best_fraction == pytest.approx(1 - 20 / 1200 - (300 + 600) / 36_000) and g.best_fraction > g.fraction
    for other in (900, 1500):  # Young/Daly's interval is the best one
        assert goodput_fraction(other, 20, 300, 36_000) < g.best_fraction
    assert goodput_fraction(10, 20, 300, 36_000) == 0.0  # saving takes longer than training between saves
    assert save_seconds(96e9, 4, 2e9) == 12.0
    assert LLAMA3_GPU_MTBF_HOURS == pytest.approx(45_570, rel=1e-3)


def test_mgpu_plan_prints_the_goodput_of_the_configured_layout():
    cfg = composed("recipe=llama3_405b_64node", "checkpoint.every_n_steps=500", "plan.restart_s=600")
    report = plan_report(cfg)
    assert "failures: one every 89.1 h for 512 GPUs (one GPU's MTBF 45,600 h" in report
    assert "a restart 600 s" in report and "checkpoint every 500 steps =" in report
    assert "Young/Daly: every" in report and "checkpoint.every_n_steps=" in report.split("Young/Daly")[1]


def test_a_background_checkpoint_blocks_only_for_its_snapshot_in_the_plan():
    """With ``checkpoint.async_save`` a checkpoint blocks for each GPU's share copied at plan.snapshot_gbs_per_gpu,
    not for the whole write: the 405B job's 4,870 GB over 512 GPUs at 10 GB/s is 0.95 s, against 38 s written at
    2 GB/s per node, and the effective training time at the same interval is higher."""
    def fraction(report):
        return float(report.split("effective training time ")[1].split("%")[0])

    sync = plan_report(composed("recipe=llama3_405b_64node", "checkpoint.every_n_steps=20"))
    background = plan_report(composed("recipe=llama3_405b_64node", "checkpoint.every_n_steps=20",
                                      "checkpoint.async_save=true"))
    assert "blocks 38.0 s, at 2 GB/s per node" in sync
    assert "blocks 1.0 s, the snapshot at 10 GB/s per GPU (plan.snapshot_gbs_per_gpu;" in background
    assert fraction(background) > fraction(sync)


def test_a_background_write_longer_than_the_interval_blocks_the_next_save():
    """``C = snapshot + max(0, write - tau)``: at tau 50 s a 60 s background write holds the next save 10 s; the best
    interval is at least the write; the snapshot copies 1/G of the bytes under ZeRO 1-2, dp/G under ZeRO 0 and 3."""
    from lightning_mgpu.planner.goodput import plan_goodput, snapshot_seconds

    g = plan_goodput(1000, 36_000, 50, 1.0, 1.0, 300, background_write_s=60.0)  # job MTBF 36 h = 129,600 s
    assert g.save_s == 11.0 and g.fraction == pytest.approx(1 - 11 / 50 - (300 + 25) / 129_600)
    assert g.best_interval_s == pytest.approx((2 * 1.0 * 129_600) ** 0.5) and g.best_interval_s > 60
    assert plan_goodput(1000, 36_000, 100, 1.0, 1.0, 300, background_write_s=60.0).save_s == 1.0
    assert plan_goodput(10**6, 36_000, 10, 1.0, 1.0, 300, background_write_s=60.0).best_interval_s == 60.0
    assert snapshot_seconds(80e9, 8, 1, 10e9) == 1.0 and snapshot_seconds(80e9, 8, 4, 10e9) == 4.0
