"""Leaving a faulty host out of a torchrun job: the decision each node's launch step takes before its agent joins.

A persistent fault (:mod:`lightning_mgpu.resilience.fingerprint`: a rank that corrupted its weights again on the
rerun) ends the job with exit status 77 and names the rank's host in the run directory's ``faulty-device.json``. A
torchrun agent joins the rendezvous before any rank of ``mgpu-train`` runs, and the rendezvous waits for every node it
was told of, so a rank cannot take its node out of the job; the node's launch step can, before its agent starts
(``sdc.exclude_faulty_hosts=true``, :mod:`lightning_mgpu.cli.node`): a node whose host the record names does not join
and exits with :data:`EXIT_EXCLUDED`; the other nodes start their agents with torchrun's elastic node range
(``--nnodes=MIN:MAX``, MIN the nodes less ``sdc.max_excluded_nodes``), whose rendezvous completes without it, and the
run resumes from its newest (layout-independent) checkpoint on the smaller world. torchrun has the node range but no
notion of a host to leave out, and SLURM's ``--exclude`` acts only at the next submission: this is the piece between.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

#: Exit status of a node that did not join because the run's record names its host: not 77 (the job found the fault),
#: not 75 (requeue me), not 76 (crash loop), not 2 (refused): the rest of the job goes on without this node.
EXIT_EXCLUDED = 78
#: The host name a rank and a node's launch step use, in place of the machine's own (for rehearsing several "nodes"
#: on one machine; unset on a cluster).
HOST_OVERRIDE = "MGPU_HOSTNAME"


def host_name() -> str:
    """This machine's name as the faulty-device record writes it: ``$MGPU_HOSTNAME`` if set, else the host name."""
    return os.environ.get(HOST_OVERRIDE) or socket.gethostname()


def named_hosts(record: Optional[dict]) -> list[str]:
    """The hosts a ``faulty-device.json`` record names persistent (sorted, each once); none without a record."""
    if not record or not record.get("persistent"):
        return []
    return sorted({h for h in record.get("ranks", {}).values() if h})


def node_range(nnodes: str, max_excluded: int) -> tuple[int, int]:
    """(MIN, MAX) of torchrun's ``--nnodes`` for a job of ``nnodes`` (``N`` or ``A:B``) that may lose
    ``max_excluded`` nodes: MAX is the nodes asked for, MIN the fewer of the range's own and MAX less those."""
    low, _, high = nnodes.partition(":")
    top = int(high or low)
    return max(1, min(int(low), top - max_excluded)), top


def node_range_problems(low: int, high: int, per_node: int, model_parallel: dict[str, int]) -> list[str]:
    """Every node count the rendezvous may complete with (``low`` to ``high``) must hold whole model replicas: its
    processes a multiple of tensor x pipeline x context sizes (``model_parallel``, by axis). Names each count that
    does not, with the numbers and the fix."""
    product = 1
    for size in model_parallel.values():
        product *= size
    axes = " x ".join(f"{name} {size}" for name, size in model_parallel.items())
    bad = [n for n in range(low, high + 1) if (n * per_node) % product]
    if not bad:
        return []
    counts = ", ".join(f"{n} nodes = {n * per_node} processes" for n in bad)
    fits = [n for n in range(low, high + 1) if not (n * per_node) % product]
    return [f"sdc.exclude_faulty_hosts: the rendezvous may complete with {low} to {high} nodes of {per_node} "
            f"processes, and {counts} cannot hold whole model replicas ({axes} = {product} processes each): lower "
            f"sdc.max_excluded_nodes" + (f" (node counts that fit: {fits})" if fits else "")
            + " or choose tensor x pipeline x context sizes that divide every such world"]


@dataclass(frozen=True)
class NodeDecision:
    """What a node's launch step does: ``join`` (start torchrun with ``--nnodes=nnodes``) or exit with ``status``,
    printing ``message``."""

    join: bool
    nnodes: str
    status: int
    message: str


def decide(record: Optional[dict], host: str, low: int, high: int, endpoint_host: str,
           record_path: str) -> NodeDecision:
    """This node's decision from the run's faulty-device ``record`` (None: no record): a named host stays out with
    :data:`EXIT_EXCLUDED`; when more hosts are named than the range may lose, or the rendezvous host itself is named,
    no node joins (status 2: the job cannot start as asked); else the node joins with ``--nnodes=low:high``."""
    hosts, may_lose = named_hosts(record), high - low
    clear = (f"once the host is replaced or tested sound, delete {record_path} (it holds the finding: step "
             f"{(record or {}).get('step')}, ranks {sorted((record or {}).get('ranks', {}))})")
    if len(hosts) > may_lose:
        return NodeDecision(False, "", 2, (
            f"faulty hosts: {record_path} names {len(hosts)} host(s) {hosts} with a persistent fault, more than the "
            f"{may_lose} this job of {high} nodes may leave out (sdc.max_excluded_nodes; the rendezvous needs "
            f"{low}): raise sdc.max_excluded_nodes, or submit on other nodes; {clear}"))
    if endpoint_host in hosts:
        return NodeDecision(False, "", 2, (
            f"faulty hosts: the rendezvous endpoint's host {endpoint_host} is named in {record_path} with a persistent "
            f"fault and will not join, so no agent could meet there: give --rdzv-endpoint a node not named; {clear}"))
    if host in hosts:
        return NodeDecision(False, "", EXIT_EXCLUDED, (
            f"faulty hosts: this node ({host}) is named in {record_path} with a persistent fault "
            f"({(record or {}).get('where') or 'a rank of it corrupted its weights again on the rerun'}); "
            f"it does not join, and the other nodes go on with "
            f"{low if low == high - 1 else f'{low} to {high - 1}'} nodes (sdc.exclude_faulty_hosts); "
            f"exit status {EXIT_EXCLUDED}. To let it join again, {clear}"))
    said = f" without {', '.join(hosts)} (named in {record_path})" if hosts else ""
    return NodeDecision(True, f"{low}:{high}", 0, f"faulty hosts: {host} joins, --nnodes={low}:{high}{said}")


def with_nnodes(torchrun_args: list[str], nnodes: str) -> list[str]:
    """torchrun's own options (before the script) with ``--nnodes`` replaced by ``nnodes``."""
    out, skip = [], False
    for arg in torchrun_args:
        if skip:
            skip = False
        elif arg == "--nnodes":
            skip = True
        elif not arg.startswith("--nnodes="):
            out.append(arg)
    return [f"--nnodes={nnodes}", *out]


def exclusion_problems(exclude: object, max_excluded: object, launcher: str, every_n_steps: object) -> list[str]:
    """``sdc.exclude_faulty_hosts`` / ``sdc.max_excluded_nodes``: the record it reads comes from the check
    (``sdc.every_n_steps``), and only torchrun's node launch step acts on it (one host runs a ``cluster=local`` job,
    whose exit 77 already stops it)."""
    out = []
    if not isinstance(max_excluded, int) or isinstance(max_excluded, bool) or max_excluded < 1:
        out.append(f"sdc.max_excluded_nodes={max_excluded!r} must be an integer >= 1 (the nodes a job may lose)")
    if not exclude:
        return out
    if every_n_steps is None:
        out.append("sdc.exclude_faulty_hosts=true leaves out hosts the silent corruption check names, and "
                   "sdc.every_n_steps=null runs no check: set sdc.every_n_steps, or sdc.exclude_faulty_hosts=false")
    if launcher != "torchrun":
        out.append(f"sdc.exclude_faulty_hosts=true acts when each node's launch step starts torchrun (cluster=torchrun, "
                   f"python -m lightning_mgpu.cli.node ...); with cluster={launcher} one launch covers every node "
                   "(cluster=local: one host, where exit 77 already stops the job): use cluster=torchrun, or leave it "
                   "false")
    return out
