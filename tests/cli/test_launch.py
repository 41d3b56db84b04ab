"""Launching: one resolved config and directory per job (multirun, submitit), SLURM scripts, and two torchrun
"nodes" on one machine."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from cli_helpers import BIN, TINY_ARGS, assert_cli_parity, cli_reference, composed, read_losses, run

from lightning_mgpu.cli.slurm import sbatch_script
from lightning_mgpu.testing import free_port

def test_multirun_gives_one_directory_and_config_per_job(token_file, tmp_path):
    sweep = tmp_path / "sweep"
    run([str(BIN / "mgpu-train"), "-m", "parallel.zero_stage=1,2", "trainer.devices=2", "data=tokens",
         f"data.path={token_file}", "trainer.max_steps=2", *TINY_ARGS, f"hydra.sweep.dir={sweep}"], tmp_path)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"]
    for job, stage in (("0", 1), ("1", 2)):
        assert OmegaConf.load(sweep / job / "config.yaml").parallel.zero_stage == stage
        assert len(read_losses(sweep / job / "metrics.csv")) == 2  # both ranks trained in this job's directory
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_submitit_runs_the_job_with_the_config_resolved_at_submission(token_file, tmp_path):
    sweep = tmp_path / "sweep"
    run([str(BIN / "mgpu-train"), "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
         # cluster.fork_on_cpu=false: ranks start from the worker command, as GPU jobs start theirs
         "trainer.devices=2", "cluster.fork_on_cpu=false", "data=tokens", f"data.path={token_file}",
         "trainer.max_steps=2", *TINY_ARGS, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert (sweep / "0" / "config.yaml").is_file()
    assert len(read_losses(sweep / "0" / "metrics.csv")) == 2
    assert list((sweep / ".submitit").iterdir())  # it really went through submitit


def _forked_rank(out: Path) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    imported = "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules
    (out / f"rank{rank}").write_text(f"{os.getppid()} {imported}")
    raise SystemExit(rank)


def test_cpu_local_ranks_are_forked_with_everything_imported_and_report_their_status(tmp_path, monkeypatch):
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from lightning_mgpu import MGPUStrategy
    from lightning_mgpu.launcher import WorkerCommandLauncher

    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")  # restored after the test
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    launcher = WorkerCommandLauncher(LightningEnvironment(), 3, 1, ["false"], fork_entry=lambda: _forked_rank(tmp_path))
    launcher._call_children_scripts()
    assert [p.wait() for p in launcher.procs] == [1, 2]  # each child's SystemExit code, as the observer polls it
    for rank in (1, 2):
        assert (tmp_path / f"rank{rank}").read_text() == f"{os.getpid()} True"  # forked from here, modules loaded

    monkeypatch.delenv("LOCAL_RANK")  # set by the launch above; with it, Lightning takes this for a started rank
    strategy = MGPUStrategy()  # what mgpu-train sets on a cluster=local job
    strategy.worker_command, strategy.fork_entry = ["false"], lambda: None
    import lightning as L

    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy.launcher.fork_entry is strategy.fork_entry  # a CPU job forks its ranks


def test_slurm_cluster_writes_the_expected_sbatch_script(tmp_path):
    cfg = composed("recipe=llama3_70b_8node", "hydra.launcher.partition=gpu", "hydra.launcher.account=proj42",
                   "hydra.launcher.timeout_min=720", return_hydra_config=True)
    script = sbatch_script(cfg.hydra.launcher, str(tmp_path))
    for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --time=720",
                 "#SBATCH --job-name=mgpu-llama3_70b"):
        assert line in script
    assert "srun" in script and "submitit.core._submit" in script  # one task per GPU, started by srun
    # SIGUSR2 to every task 2 minutes before the time limit: every rank stops after its step, saves and requeues
    assert "#SBATCH --signal=USR2@120" in script


def test_two_torchrun_nodes_train_dp2_zero2_at_parity_through_a_restart(token_file, tmp_path):
    """Two torchrun "nodes" of one process each (c10d rendezvous, ``--max-restarts=1``), ZeRO-2 over the two
    replicas, one on each node. Rank 1 is killed as step 3 begins: both agents start their ranks again, one counting a
    restart, the other (its rank was healthy) a membership change it does not count, so the two ranks see different
    ``TORCHELASTIC_RESTART_COUNT``s. torchrun keeps its store across restarts; the ranks agree on a name for the new
    attempt and see the store through it (``lightning_mgpu.parallel.process_group.attempt_store``), or they could
    read the failed attempt's addresses (or, keyed on the count, each other's wrong keys: the job hung). They resume from step 2's checkpoint and finish at parity with one process; every rank uses
    one run directory, whose metrics.csv keeps the steps before the restart; the per-step metrics of one step are on
    one row. (One process per node: every rank is a fresh interpreter, 8 s of imports on two cores each; the splits
    within a node are tested on forked ranks.)"""
    port, run_dir = free_port(), tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", MGPU_KILL_RANK_AT="1:3")
    procs = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", "-m", "lightning_mgpu.train", "cluster=torchrun",
         "parallel.zero_stage=2", "data=tokens", f"data.path={token_file}",
         "trainer.max_steps=4", "trainer.gradient_clip_val=0.3", "checkpoint.every_n_steps=2", "checkpoint.resume=auto",
         *TINY_ARGS, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    both = outputs[0] + outputs[1]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "MGPU fault: rank 1 kills itself (SIGKILL) at step 3" in both
    assert "Restart 1: resumed at step 2; the attempt before reached step 3: 1 step(s) lost" in both, both[-3000:]
    assert "global batch 8 = 2 per micro-batch x 2 micro-batches x 2 data-parallel replicas" in both
    assert "ZeRO-2 over 2 data-parallel replicas" in both
    assert "--- sample after 4 steps ---" in both
    assert (run_dir / "config.yaml").is_file()
    assert not list(tmp_path.glob("outputs"))  # every rank used the one run directory
    # metrics.csv kept the first attempt's steps 0-1 and holds every step once
    assert_cli_parity(run_dir / "metrics.csv", cli_reference(token_file, 4))
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("train/loss")]
    for r in rows:  # the other per-step metrics belong to the same step as the loss
        assert float(r["train/ppl"]) == pytest.approx(math.exp(float(r["train/loss"])), rel=1e-5)
        assert float(r["perf/tokens_per_s"]) > 0 and float(r["perf/tflops_per_gpu"]) > 0  # ThroughputCallback
        assert float(r["train/tokens_seen"]) == (int(r["step"]) + 1) * 8 * 16


def test_tiny_cpu_recipe_trains_3d_on_four_processes(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([str(BIN / "mgpu-train"), "recipe=tiny_cpu", "trainer.max_steps=3", "trainer.enable_progress_bar=false",
                f"hydra.run.dir={run_dir}"], tmp_path)
    assert "global batch 16 = 4 per micro-batch x 4 micro-batches x 1 data-parallel replicas" in proc.stdout + proc.stderr
    assert len(read_losses(run_dir / "metrics.csv")) == 3

