"""Leaving a faulty host out of a torchrun job (``sdc.exclude_faulty_hosts``): each node's launch step decides, before
its agent joins, whether it joins and with which node range. Every expected value here is worked out by hand."""

import os
import subprocess
import sys

import pytest
from cli_helpers import TINY_ARGS, composed
from torch.distributed.run import get_args_parser

from lightning_mgpu.cli.node import _decide, job_status
from lightning_mgpu.resilience.faulty_hosts import (EXIT_EXCLUDED, decide, exclusion_problems, host_name,
                                                    node_range, node_range_problems, with_nnodes)
from lightning_mgpu.resilience.restarts import record_faulty_device

# rank 5 of 4 nodes x 2 ranks named persistent; it runs on node-c beside rank 4, whose copy agrees
RECORD = {"step": 40, "ranks": {"5": "node-c"}, "where": "rank 5 shares host node-c with ranks [4], whose copies "
          "agree: one device (rank 5's), not the node", "persistent": True}


def test_the_named_host_stays_out_with_a_status_of_its_own():
    said = decide(RECORD, "node-c", 3, 4, "node-a", "/runs/x/faulty-device.json")
    assert (said.join, said.status) == (False, 78) and EXIT_EXCLUDED not in (75, 76, 77, 2)
    assert "this node (node-c) is named in /runs/x/faulty-device.json" in said.message
    assert "one device (rank 5's)" in said.message  # the record's own verdict
    assert "the other nodes go on with 3 nodes" in said.message
    assert "go on with 2 to 3 nodes" in decide(RECORD, "node-c", 2, 4, "node-a", "/r/f.json").message
    assert "delete /runs/x/faulty-device.json" in said.message and "step 40, ranks ['5']" in said.message


def test_the_other_nodes_join_with_the_elastic_node_range():
    for host in ("node-a", "node-b", "node-d"):
        said = decide(RECORD, host, 3, 4, "node-a", "/runs/x/faulty-device.json")
        assert (said.join, said.nnodes, said.status) == (True, "3:4", 0)
        assert "without node-c" in said.message
    clean = decide(None, "node-c", 3, 4, "node-a", "/r/faulty-device.json")  # no record: every node joins
    assert (clean.join, clean.nnodes) == (True, "3:4")
    transient = decide({**RECORD, "persistent": False}, "node-c", 3, 4, "node-a", "/r/f.json")
    assert transient.join  # only a persistent finding leaves a host out


def test_more_named_hosts_than_the_range_may_lose_stops_every_node():
    two = {"step": 8, "ranks": {"1": "node-a", "6": "node-d"}, "persistent": True}
    for host in ("node-a", "node-b"):
        said = decide(two, host, 3, 4, "node-b", "/r/faulty-device.json")
        assert (said.join, said.status) == (False, 2)
        assert "names 2 host(s) ['node-a', 'node-d']" in said.message and "more than the 1" in said.message
    # the rendezvous host itself named: nobody could meet there
    said = decide(RECORD, "node-a", 3, 4, "node-c", "/r/faulty-device.json")
    assert (said.join, said.status) == (False, 2) and "rendezvous endpoint's host node-c" in said.message


def test_node_range_and_the_launch_command():
    assert node_range("4", 1) == (3, 4)
    assert node_range("4", 2) == (2, 4)
    assert node_range("2:4", 1) == (2, 4)  # the range's own lower end is kept when lower
    assert node_range("1", 1) == (1, 1)  # a one-node job cannot lose its node
    args = ["--nnodes", "4", "--nproc-per-node=8", "--rdzv-backend=c10d", "-m"]
    assert with_nnodes(args, "3:4") == ["--nnodes=3:4", "--nproc-per-node=8", "--rdzv-backend=c10d", "-m"]
    assert with_nnodes(["--nnodes=4", "-m"], "3:4") == ["--nnodes=3:4", "-m"]


def test_the_job_status_a_scheduler_acts_on_is_kept():
    # torchrun exits with 1 for any failed job; the launch step keeps the statuses that say what to do next
    assert [job_status(c) for c in (75, 76, 77, 2)] == [75, 76, 77, 2]
    assert [job_status(c) for c in (1, 137, -9, 139, 78)] == [1, 1, 1, 1, 1]


def test_a_smaller_world_that_cannot_hold_the_layout_is_refused_with_its_numbers():
    # 8 processes a node, tp 8 x pp 2 = 16 a replica: 4 nodes (32) hold 2 replicas, 3 nodes (24) do not
    said = node_range_problems(3, 4, 8, {"tensor": 8, "pipeline": 2, "context": 1})
    assert len(said) == 1
    assert "3 nodes = 24 processes cannot hold whole model replicas (tensor 8 x pipeline 2 x context 1 = 16" in said[0]
    assert "4 nodes = 32" not in said[0] and "node counts that fit: [4]" in said[0]
    assert node_range_problems(2, 4, 8, {"tensor": 8, "pipeline": 1, "context": 1}) == []


def test_the_settings_are_checked_with_every_problem_at_once(monkeypatch):
    said = exclusion_problems(True, 0, "local", None)
    assert len(said) == 3
    assert "sdc.max_excluded_nodes=0 must be an integer >= 1" in said[0]
    assert "sdc.every_n_steps=null runs no check" in said[1] and "cluster=local" in said[2]
    assert exclusion_problems(True, 1, "torchrun", 10) == [] and exclusion_problems(False, 1, "local", None) == []
    monkeypatch.setenv("MGPU_HOSTNAME", "node-x")
    assert host_name() == "node-x"


ARGS = ["--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29999", "--rdzv-id=job",
        "-m", "lightning_mgpu.train"]


def _cfg(run_dir, token_file, *extra):
    return composed("cluster=torchrun", "data=tokens", f"data.path={token_file}", "sdc.every_n_steps=2", "sdc.exclude_faulty_hosts=true",
                    "checkpoint.every_n_steps=2", "checkpoint.keep_last=3", "checkpoint.resume=auto", *TINY_ARGS,
                    f"hydra.run.dir={run_dir}", *extra, return_hydra_config=True)


def test_the_launch_step_decides_from_the_run_directory(tmp_path, token_file, monkeypatch):
    """The real launch step (config composed, the record read from the run directory, every smaller world checked
    against the config's rules): node-b joins with 1:2, node-c, named, stays out; a layout or a batch that a smaller
    world cannot hold is refused, naming the world."""
    record_faulty_device(tmp_path, {"step": 4, "ranks": {"1": "node-c"}, "where": ""}, 0)
    args = get_args_parser().parse_args(["--nnodes=2", *ARGS])
    monkeypatch.setenv("MGPU_HOSTNAME", "node-b")
    assert _decide(_cfg(tmp_path, token_file), args) == ("1:2", [])
    monkeypatch.setenv("MGPU_HOSTNAME", "node-c")
    assert _decide(_cfg(tmp_path, token_file), args) == (78, [])
    monkeypatch.setenv("MGPU_HOSTNAME", "node-b")
    four = get_args_parser().parse_args(["--nnodes=4", *ARGS])
    _, said = _decide(_cfg(tmp_path, token_file, "parallel.tensor_parallel_size=2"), four)  # 4 ranks hold tp2
    assert len(said) == 1 and "3 nodes = 3 processes cannot hold whole model replicas" in said[0]
    # global batch 8 of micro-batches of 2: 3 replicas cannot split it, 4 can (the config's own rule says so)
    _, said = _decide(_cfg(tmp_path, token_file), four)
    assert said and all(s.startswith("with 3 of 4 nodes (3 processes): ") for s in said), said
    bad = _decide(_cfg(tmp_path, token_file, "sdc.max_excluded_nodes=0"), args)[1]  # the run as asked: no prefix
    assert bad == ["sdc.max_excluded_nodes=0 must be an integer >= 1 (the nodes a job may lose)"]
    static = get_args_parser().parse_args(["--nnodes=2", "--nproc-per-node=1", "-m", "lightning_mgpu.train"])
    assert "static rendezvous" in _decide(_cfg(tmp_path, token_file), static)[1][0]


def test_the_named_node_exits_78_from_the_command_line(tmp_path, token_file):
    """``python -m lightning_mgpu.cli.node`` on the named host: it prints why and how to clear the record, and exits
    with 78 without starting torchrun."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_faulty_device(run_dir, {"step": 4, "ranks": {"1": "node-c"}, "where": ""}, 0)
    proc = subprocess.run([sys.executable, "-m", "lightning_mgpu.cli.node", "--nnodes=2", *ARGS, "cluster=torchrun",
                           "data=tokens", f"data.path={token_file}", "sdc.every_n_steps=2",
                           "sdc.exclude_faulty_hosts=true", "checkpoint.every_n_steps=2", "checkpoint.keep_last=3", "checkpoint.resume=auto", *TINY_ARGS, f"hydra.run.dir={run_dir}"],
                          env=dict(os.environ, MGPU_HOSTNAME="node-c"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert f"this node (node-c) is named in {run_dir}/faulty-device.json" in proc.stderr
    assert "torch.distributed.run" not in proc.stdout + proc.stderr
