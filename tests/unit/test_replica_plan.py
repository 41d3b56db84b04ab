"""The planner's cost of replicas that step alone (``lightning_mgpu.planner.replicas``): the outer step's fp32 copies,
its cross-replica bytes and the bandwidth that hides it, against hand-computed numbers; ``mgpu-plan``'s block for the
two-site recipe, its command lines (replica settings kept, each accepted and dry-run), and the recipe's dry run."""

import re
import shlex

import pytest
from forked_cli import run_cli
from cli_helpers import BIN, composed, resolved

from lightning_mgpu.cli.dry_run import dry_run_report
from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.memory_check import run_memory
from lightning_mgpu.cli.plan import compose_plan_config, plan_report
from lightning_mgpu.cli.plan_replicas import replica_rows
from lightning_mgpu.cli.spec import config_problems, run_spec
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner import GPUS, ClusterSpec
from lightning_mgpu.planner.model_stats import max_rank_parameters
from lightning_mgpu.planner.replicas import master_share, outer_copy_bytes, replica_cluster, replica_traffic

GB = 1e9
RECIPE = "llama3_8b_2site"
#: A slow link between two sites: 10 Gbit/s.
SITE_LINK = 1.25e9


def test_the_formulas_on_a_tiny_case():
    """R = 2, 1,000 master parameters per GPU, H = 4, 8 GPUs a replica, 0.5 s an inner step, bf16 gradients."""
    t = replica_traffic(1000, replicas=2, sync_every=4, gpus_per_replica=8, momentum=0.9, step_seconds=0.5)
    assert t.extra_memory == 8000  # 4 B the last outer weights + 4 B the outer momentum
    assert t.outer_bytes == 4000  # ring all-reduce: 2 (R-1)/R x 4 B x 1000
    assert t.sync_bytes == 2000  # the same share's bf16 gradients over the replica axis, every step
    assert t.site_outer_bytes == 32_000 and t.job_outer_bytes == 64_000
    assert t.bandwidth_per_gpu == 2000  # 4000 B in 4 steps x 0.5 s
    assert t.bandwidth_per_site == 16_000
    four = replica_traffic(1000, replicas=4, sync_every=4, gpus_per_replica=8, momentum=0.0, precision="32-true")
    assert four.outer_bytes == 6000 and four.sync_bytes == 6000  # 2 x 3/4 x 4 B x 1000
    assert four.extra_memory == 4000  # no momentum: torch's SGD keeps no buffer
    assert four.bandwidth_per_gpu is None and four.bandwidth_per_site is None  # no step time, no bandwidth


def test_a_rank_s_share_and_its_copies():
    cfg = LlamaConfig.from_name("llama3_8b")
    held = max_rank_parameters(cfg, 2, 1)
    assert master_share(cfg, 2, 1, 1, zero_ranks=8, zero_stage=1) == held / 8  # partitioned from ZeRO-1 on
    assert master_share(cfg, 2, 1, 1, zero_ranks=8, zero_stage=0) == held  # ZeRO-0: the whole shard
    assert outer_copy_bytes(1e6, 0.9) == 8e6 and outer_copy_bytes(1e6, 0.0) == 4e6
    # async: the round's starting weights and a copy of the masters whole, and a slice of 4 owned: its weights,
    # momentum and up to max_staleness + 1 rounds' sums
    assert outer_copy_bytes(1e6, 0.9, "async", 4, max_staleness=2) == 4e6 * (2 + (1 + 1 + 3) / 4)
    assert outer_copy_bytes(1e6, 0.0, "async", 2) == 4e6 * (2 + (1 + 1) / 2)


@pytest.mark.parametrize("precision, gradient_bytes", [("bf16-mixed", 2), ("32-true", 4)])
@pytest.mark.parametrize("H", [1, 4, 128])
def test_an_outer_step_sends_at_most_one_H_th_of_sync_over_H_steps_per_byte_of_gradient(precision, gradient_bytes, H):
    """Over H inner steps, one outer step of fp32 weights against H synchronised steps of gradients: 1/H of their bytes
    at fp32 gradients, 2/H at bf16 (an fp32 weight is twice a bf16 gradient)."""
    t = replica_traffic(12345, replicas=2, sync_every=H, gpus_per_replica=16, momentum=0.9, precision=precision)
    over_h_synced_steps = H * t.sync_bytes
    assert t.outer_bytes == pytest.approx(over_h_synced_steps / H * 4 / gradient_bytes)
    assert t.outer_bytes / (4 / gradient_bytes) <= over_h_synced_steps / H * (1 + 1e-12)


def test_bad_input_is_refused_with_every_problem():
    with pytest.raises(ValueError) as err:
        replica_traffic(-1, replicas=0, sync_every=0, gpus_per_replica=8, momentum=0.9, step_seconds=0)
    text = str(err.value)
    for fragment in ("replicas=0 must be an integer >= 1", "sync_every=0 must be an integer >= 1", "share=-1 must",
                     "step_seconds=0 must be > 0"):
        assert fragment in text
    with pytest.raises(ValueError, match="replicas=3 does not split 4 node"):
        replica_cluster(ClusterSpec(4, 8, GPUS["h100_80gb"]), 3)
    assert replica_cluster(ClusterSpec(4, 8, GPUS["h100_80gb"]), 2).nodes == 2
    assert replica_cluster(ClusterSpec(1, 8, GPUS["h100_80gb"]), 4).gpus_per_node == 2


def test_the_memory_check_counts_the_outer_copies_once():
    """``mgpu-train``'s memory check adds what the planner's rule says: 8 B per parameter of the share, 4 B without
    outer momentum, nothing under sync."""
    base = ["model=llama3_8b", "trainer=gpu", "trainer.devices=8", "trainer.num_nodes=2", "data.seq_len=1024",
            "data.global_batch_size=16", "parallel.tensor_parallel_size=2", "parallel.zero_stage=2"]
    local = [*base, "parallel.replicas=2", "parallel.replica_update=local"]
    sync = run_memory(resolved(composed(*base)), True)
    share = max_rank_parameters(LlamaConfig.from_name("llama3_8b"), 2, 1) / 4  # ZeRO over 4 ranks of a replica
    with_momentum = run_memory(resolved(composed(*local)), True)
    plain = run_memory(resolved(composed(*local, "parallel.outer_optimizer.name=sgd",
                                         "parallel.outer_optimizer.momentum=0")), True)
    # one node alone is one replica of the 2-node job: ZeRO over its 4 data ranks
    replica_states = run_memory(resolved(composed(*base, "trainer.num_nodes=1")), True).model_states
    assert with_momentum.model_states - replica_states == pytest.approx(8 * share)
    assert plain.model_states - replica_states == pytest.approx(4 * share)
    assert sync.model_states < replica_states


def _block(report: str) -> dict:
    """The figures of mgpu-plan's replica block."""
    text = report.split("\nreplicas: ")[1].split("\n\n")[0]
    number = r"([\d.,]+)"
    found = {
        "extra": re.search(rf"extra memory: {number} GB per GPU", text),
        "per_gpu": re.search(rf"cross-replica bytes per outer step: {number} GB per GPU", text),
        "site": re.search(rf"{number} GB per replica \(its site link\)", text),
        "job": re.search(rf"{number} GB for the job", text),
        "step": re.search(rf"inner steps of {number} s", text),
        "bw_gpu": re.search(rf"hidden behind \d+ inner steps of [\d.]+ s: {number} GB/s", text),
        "bw_site": re.search(rf"{number} GB/s \([\d.]+ Gbit/s\) per site link \(sync, every step", text),
    }
    assert all(found.values()), (text, {k: v for k, v in found.items() if not v})
    return {key: float(m.group(1).replace(",", "")) for key, m in found.items()}


def test_mgpu_plan_prints_the_replica_block_of_the_recipe_and_it_hides_behind_a_slow_link():
    cfg = compose_plan_config([f"recipe={RECIPE}"])
    report = plan_report(cfg, [f"recipe={RECIPE}"])
    assert "2 replicas stepping alone (replica_update=local): the layouts are one replica's, on its 16 GPUs" in report
    assert f"replicas: 2 of 16 GPUs each (replica_update=local, an outer step every sync_every=" \
           f"{cfg.parallel.sync_every} inner steps" in report
    figures = _block(report)
    share = max_rank_parameters(LlamaConfig.from_name("llama3_8b"), 2, 1) / 8  # tp 2, ZeRO over 8 ranks a site
    assert figures["extra"] == pytest.approx(8 * share / GB, abs=0.006)
    assert figures["per_gpu"] == pytest.approx(4 * share / GB, abs=0.006)  # R = 2: 2 x 1/2 x 4 B
    assert figures["site"] == pytest.approx(16 * 4 * share / GB, abs=0.06)
    assert figures["job"] == pytest.approx(2 * 16 * 4 * share / GB, abs=0.06)
    bandwidth = 16 * 4 * share / (cfg.parallel.sync_every * figures["step"])
    assert figures["bw_site"] == pytest.approx(bandwidth / GB, rel=0.01)
    assert figures["bw_gpu"] == pytest.approx(bandwidth / 16 / GB, rel=0.01)
    assert figures["bw_site"] * GB < SITE_LINK  # the recipe's claim: hidden behind a 10 Gbit/s link
    # the configured layout's memory, copies included, is what mgpu-train's memory check estimates for it
    planned = re.search(r"this configuration: .*?: ([\d.]+) GB per GPU", report).group(1)
    checked = run_memory(resolved(composed(f"recipe={RECIPE}", "cluster=local")), True).total
    assert float(planned) == pytest.approx(checked / GB, abs=0.06)


def test_the_search_of_one_replica_leaves_out_what_the_outer_step_refuses():
    """ZeRO-0 in bf16 keeps no fp32 masters the outer step can update: no such row; in 32-true it has them."""
    overrides = ["model=llama3_8b", "trainer=gpu", "trainer.num_nodes=2", "data.seq_len=1024", "parallel.replicas=2",
                 "parallel.replica_update=local"]
    inner = ClusterSpec(1, 8, GPUS["h100_80gb"])
    model = LlamaConfig.from_name("llama3_8b", max_seq_len=1024)
    bf16 = replica_rows(compose_plan_config(overrides), model, inner, "bf16-mixed")
    fp32 = replica_rows(compose_plan_config(overrides), model, inner, "32-true")
    assert bf16 and all(r.candidate.zero_stage > 0 for r in bf16)
    assert any(r.candidate.zero_stage == 0 for r in fp32)


def test_mgpu_plan_refuses_replicas_that_mgpu_train_refuses():
    with pytest.raises(ConfigError, match="parallel.replicas=2 splits the data-parallel ranks"):
        plan_report(compose_plan_config(["model=llama3_8b", "trainer.num_nodes=2", "parallel.replicas=2"]))
    with pytest.raises(ConfigError, match="parallel.replicas=3 does not split 2 node"):
        plan_report(compose_plan_config(["model=llama3_8b", "trainer.num_nodes=2", "parallel.replicas=3",
                                         "parallel.replica_update=local", "data.global_batch_size=48"]))


@pytest.mark.parametrize("update", ["local", "async"])
def test_the_commands_mgpu_plan_suggests_keep_the_replica_settings_and_dry_run(update):
    """Replica settings passed on the command line survive in every suggested command, which mgpu-train accepts
    (no ZeRO-0 under bf16, replicas dividing the data ranks) and dry-runs."""
    replica_settings = ["parallel.replicas=2", f"parallel.replica_update={update}", "parallel.sync_every=16",
                        "parallel.max_staleness=1", "parallel.outer_optimizer.momentum=0.8"]
    overrides = ["model=llama3_8b", "trainer=gpu", "cluster=local", "trainer.num_nodes=4", "data.seq_len=4096",
                 "data.global_batch_size=64", *replica_settings, "plan.commands=3"]
    report = plan_report(compose_plan_config(overrides), overrides)
    commands = [shlex.split(line.strip())[1:] for line in report.splitlines() if line.startswith("  mgpu-train ")]
    assert len(commands) == 3
    for command in commands:
        assert set(replica_settings) <= set(command), command
        cfg = composed(*command)
        assert config_problems(cfg, launching=False) == [], command
        assert "x 2 replicas (an outer step every 16)" in dry_run_report(run_spec(cfg, launching=False))


def test_the_recipe_dry_runs_and_prints_its_cross_replica_bytes(tmp_path):
    """``mgpu-train recipe=llama3_8b_2site dry_run=true`` on this machine: exit 0, the layout, and the bytes per outer
    step from the built shares (the fullest built rank's share over ZeRO's 8 ranks of a site)."""
    proc = run_cli([str(BIN / "mgpu-train"), f"recipe={RECIPE}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "32 processes = tp 2 x pp 1 x dp 8 x 2 replicas" in proc.stdout
    built = max(int(line.split("|")[4].replace(",", ""))
                for line in proc.stdout.splitlines() if re.match(r"\| \d", line))
    per_gpu = re.search(r"cross-replica bytes per outer step \(every \d+ steps\): ([\d.]+) GB sent per GPU",
                        proc.stdout)
    assert per_gpu, proc.stdout
    assert float(per_gpu.group(1)) == pytest.approx(4 * built / 8 / GB, abs=0.006)
    assert not (tmp_path / "run" / "config.yaml").exists()
