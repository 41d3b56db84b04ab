"""Every data-parallel rank's own DataLoader position in a checkpoint.

Lightning saves the state of a training loader that has ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``) in its fit loop's state, and restores it on resume: the run continues mid-epoch with the next
unseen samples instead of starting the epoch again. Lightning writes the trainer state of one process, as under DDP
where every rank would have saved the same thing; here the ranks of a data-parallel group read different samples, and
only rank 0's trainer state is written. So the save gathers the loader state of each data-parallel rank (the ranks that
differ only in tensor, context or pipeline coordinate read the same data) and each rank takes back its own on resume.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.collectives import gather_objects

#: The trainer-state key of ``{data rank: that rank's loader states}``.
KEY = "mgpu_loader_states_by_data_rank"


def _fit_loop_state(trainer_state: dict) -> dict:
    """The fit loop's own state, where Lightning keeps ``combined_loader`` (empty when the checkpoint has none)."""
    return trainer_state.get("loops", {}).get("fit_loop", {}).get("state_dict", {})


def with_every_loader_state(trainer_state: dict, layout: ParallelLayout) -> dict:
    """``trainer_state`` with each data-parallel rank's loader states under :data:`KEY` (a collective: every rank
    calls it); unchanged when no loader has a state."""
    own = _fit_loop_state(trainer_state).get("combined_loader")
    gathered = gather_objects((layout.rank("data"), own))
    if all(states is None for _rank, states in gathered):
        return trainer_state
    by_data_rank: dict[int, Any] = {}
    for data_rank, states in gathered:
        by_data_rank.setdefault(data_rank, states)
    return dict(trainer_state, **{KEY: by_data_rank})


def take_own_loader_state(trainer_state: dict, layout: ParallelLayout) -> dict:
    """``trainer_state`` with this rank's own loader states where rank 0's are; when the checkpoint was written by
    another number of data-parallel ranks, without any (each loader starts its epoch again, as a plain ``DataLoader``
    does), and a warning says so."""
    saved = trainer_state.pop(KEY, None)
    loop = _fit_loop_state(trainer_state)
    if saved is None or "combined_loader" not in loop:
        return trainer_state
    if len(saved) == layout.size("data"):
        loop["combined_loader"] = saved[layout.rank("data")]
        return trainer_state
    del loop["combined_loader"]
    rank_zero_warn(f"the checkpoint holds the DataLoader positions of {len(saved)} data-parallel ranks and this run has "
                   f"{layout.size('data')}: each rank's loader starts its epoch again, so the samples seen differ from "
                   "an uninterrupted run's; resume on the same number of data-parallel ranks to continue exactly")
    return trainer_state
