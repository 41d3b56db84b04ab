"""Start the local ranks of a job with a fixed worker command instead of re-running the calling script.

Lightning's subprocess launcher starts ranks 1..N-1 by re-running ``sys.argv``; under Hydra each child then
composes and resolves its own config (its own ``${now:...}``), and under a multirun sweep each child would
start the whole sweep again. With a worker command (``mgpu-train`` passes one that loads the run
directory's resolved ``config.yaml``) every rank uses the one config and the one directory. The
environment handed to children is Lightning's: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
``WORLD_SIZE`` and each child's ``LOCAL_RANK``; the loop is restated here because Lightning builds the
command inside it.
"""

from __future__ import annotations

import os
import subprocess
from typing import Sequence

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override


class WorkerCommandLauncher(_SubprocessScriptLauncher):
    """A ``_SubprocessScriptLauncher`` whose children run ``command`` (from ``cwd``)."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, command: Sequence[str],
                 cwd: str | None = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.command, self.cwd = list(command), cwd

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ.update({"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                           "NODE_RANK": str(env.node_rank()), "LOCAL_RANK": str(env.local_rank()),
                           "WORLD_SIZE": str(self.num_processes * self.num_nodes)})
        for local_rank in range(1, self.num_processes):
            child_env = dict(os.environ, LOCAL_RANK=str(local_rank))
            self.procs.append(subprocess.Popen(self.command, env=child_env, cwd=self.cwd))
