"""The warnings a run of ``mgpu-train`` does not print: each comes from a library the package calls, says nothing the
user can act on, and is known to be harmless here (the reason stands beside each filter). Everything else is printed.

Filters are set in the launching process before anything is imported that warns, and the ranks forked from it inherit
them; ranks started as fresh interpreters (GPU jobs) run the same entry point, which sets them again.
"""

from __future__ import annotations

import warnings
from pathlib import Path

#: (message pattern, category, why it is harmless here)
KNOWN_HARMLESS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     "Lightning's own copy of torch's tree flattening (lightning.pytorch.utilities._pytree) builds a LeafSpec; torch "
     "2.13 deprecates the class, and the flattening it does is unchanged"),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning,
     "DeepSpeed's ZeRO gathers call it; torch 2.13 renamed the collective (all_gather_single) and runs the same one"),
    (r"Your `IterableDataset` has `__len__` defined", UserWarning,
     "Lightning warns of any sized IterableDataset in case several loader workers duplicate its data; the package's "
     "loaders (lightning_mgpu.data.tokens) read in the rank's own process (num_workers=0), each rank its own slice"),
)


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_HARMLESS` (in this process and the ranks it forks)."""
    for pattern, category, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def quiet_a_new_run_directory(run_dir: Path) -> None:
    """Lightning's CSV logger warns that a non-empty directory's earlier logs will be deleted; a new run's directory
    holds Hydra's own files (``.hydra/``, the job's log) and no metrics, so there is nothing to lose. A directory that
    already holds ``metrics.csv`` (a run written there before) keeps the warning."""
    if not (run_dir / "metrics.csv").exists():
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
