"""``python -m lightning_mgpu.cli.node``: one node's launch step of a ``cluster=torchrun`` job, run on every node where
``torchrun`` would be, with torchrun's own arguments::

    python -m lightning_mgpu.cli.node --nnodes=4 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$JOB -m lightning_mgpu.train cluster=torchrun recipe=... \\
        sdc.every_n_steps=100 sdc.exclude_faulty_hosts=true

It composes the run's config from the overrides, as ``mgpu-train`` will. With ``sdc.exclude_faulty_hosts=true`` it
reads the run directory's ``faulty-device.json`` (:mod:`lightning_mgpu.resilience.faulty_hosts`): a node whose host is
named there prints why and exits with 78 instead of joining; the others check every world the rendezvous may complete
with against the config's rules and then run torchrun in this process (its agent handles the scheduler's signals as
under torchrun) with ``--nnodes=MIN:MAX``. Without the setting it runs torchrun unchanged. torchrun itself has no such
step: its agent joins the rendezvous first, which is too late to stay out. Where torchrun exits with 1 for any failed
job, this step exits with the first failure's status when a scheduler acts on it (75 requeue, 77 a faulty device, 76,
2), so that a script can tell a persistent fault from "requeue me".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from omegaconf import DictConfig, open_dict

from lightning_mgpu.cli.errors import exit_on_refusal
from lightning_mgpu.problems import format_problems
from lightning_mgpu.resilience.faulty_hosts import decide, host_name, node_range, node_range_problems, with_nnodes
from lightning_mgpu.resilience.preemption import REQUEUE_EXIT
from lightning_mgpu.resilience.restarts import (EXIT_CRASH_LOOP, EXIT_FAULTY_DEVICE, EXIT_REFUSED, FAULTY_DEVICE,
                                                read_faulty_device)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Decide, then run torchrun or exit with the decision's status."""
    from torch.distributed.run import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    script = argv[len(argv) - len(args.training_script_args) - 1:]  # the module or script and its overrides
    torchrun_args = argv[: len(argv) - len(script)]
    composed: list[DictConfig] = []  # a typo'd override is refused as mgpu-train refuses it (status 2)
    exit_on_refusal(lambda: composed.append(_composed(args.training_script_args)))
    cfg = composed[0]
    if cfg.sdc.exclude_faulty_hosts:
        nnodes, problems = _decide(cfg, args)
        if problems:
            print(format_problems("this node does not start torchrun", problems), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_REFUSED)
        if isinstance(nnodes, int):
            raise SystemExit(nnodes)
        torchrun_args = with_nnodes(torchrun_args, nnodes)
    raise SystemExit(_run_torchrun([*torchrun_args, *script]))


def _run_torchrun(argv: list[str]) -> int:
    """torchrun, run in this process (its agent installs its signal handlers here, as under torchrun); the job's exit
    status. torchrun's own is 1 for any failure; here it is the first failure's where that tells a scheduler what to do
    (:func:`job_status`), and 75 when the agent was told to stop by SIGTERM, SIGUSR1, SIGUSR2 or SIGHUP, as under
    ``cluster=local``."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from lightning_mgpu.resilience.elastic import PREEMPTING

    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        print(failed.format_msg(), file=sys.stderr, flush=True)
        return job_status(failed.get_first_failure()[1].exitcode)
    except SignalException as stop:
        return REQUEUE_EXIT if stop.sigval in PREEMPTING else 128 + stop.sigval
    return 0


def job_status(exitcode: int) -> int:
    """A failed torchrun job's exit status from its first failure's: kept where it says what to do next (75 requeue,
    77 a faulty device, 76 a crash loop, 2 refused), else torchrun's 1."""
    return exitcode if exitcode in (REQUEUE_EXIT, EXIT_FAULTY_DEVICE, EXIT_CRASH_LOOP, EXIT_REFUSED) else 1


def _decide(cfg: DictConfig, args: argparse.Namespace) -> tuple[object, list[str]]:
    """(``--nnodes``'s value, or the exit status of a node that stays out; every problem of the worlds it may start
    with)."""
    run_dir = Path(_run_dir(cfg, args.rdzv_id))
    if not str(args.nproc_per_node).isdigit():
        return None, [f"--nproc-per-node={args.nproc_per_node}: with sdc.exclude_faulty_hosts give the processes of "
                      "a node as a number (the worlds the rendezvous may complete with are checked before it starts)"]
    if args.rdzv_backend == "static":
        return None, ["sdc.exclude_faulty_hosts starts the nodes with an elastic node range, which torchrun's static "
                      "rendezvous does not take: give --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB"]
    per_node, top = int(args.nproc_per_node), int(args.nnodes.rpartition(":")[2])
    full = _world_problems(cfg, [top], per_node, top)  # the run as asked, and the settings themselves
    if full:
        return None, full
    low, high = node_range(args.nnodes, cfg.sdc.max_excluded_nodes)
    decision = decide(read_faulty_device(run_dir), host_name(), low, high, args.rdzv_endpoint.rpartition(":")[0],
                      str(run_dir / FAULTY_DEVICE))
    if not decision.join:  # this node starts nothing: the worlds the others may start are theirs to check
        print(decision.message, file=sys.stderr, flush=True)
        return decision.status, []
    p = cfg.parallel
    problems = node_range_problems(low, high, per_node, {
        "tensor": p.tensor_parallel_size, "pipeline": p.pipeline_parallel_size, "context": p.context_parallel_size})
    problems = problems or _world_problems(cfg, range(high - 1, low - 1, -1), per_node, high)
    if not problems:
        print(decision.message, flush=True)
    return decision.nnodes, problems


def _world_problems(cfg: DictConfig, counts: Iterable[int], per_node: int, high: int) -> list[str]:
    """The config's own rules (the batch split, the layout) at each node count of ``counts``; the problems of a world
    smaller than ``high`` nodes are prefixed with it."""
    from lightning_mgpu.cli.spec import config_problems

    plain, out = cfg.copy(), []
    with open_dict(plain):
        del plain["hydra"]  # Hydra's own node, read for the run directory; not a setting of the run
    for nodes in counts:
        with _environment(WORLD_SIZE=str(nodes * per_node), LOCAL_WORLD_SIZE=str(per_node)):
            said = config_problems(plain, launching=False)
        out += said if nodes == high else [f"with {nodes} of {high} nodes ({nodes * per_node} processes): {p}"
                                           for p in said]
    return out


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``values`` in this process's environment for a while (the config's resolvers read torchrun's variables)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _composed(overrides: Sequence[str]) -> DictConfig:
    """The config ``mgpu-train`` composes from ``overrides``, Hydra's own node included (for the run directory)."""
    from hydra import compose, initialize_config_dir

    from lightning_mgpu.cli.config import register_configs
    from lightning_mgpu.cli.paths import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def _run_dir(cfg: DictConfig, rdzv_id: str) -> str:
    """The run directory the job's ranks will use: ``hydra.run.dir``, which ``cluster=torchrun`` names after
    torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID`` in the ranks)."""
    with _environment(TORCHELASTIC_RUN_ID=rdzv_id):
        return str(cfg.hydra.run.dir)


if __name__ == "__main__":
    main()
