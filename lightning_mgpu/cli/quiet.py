"""The warnings a run of ``mgpu-train`` does not print: each comes from a library the package calls, says nothing the
user can act on, and is known to be harmless here (the reason stands beside each filter). Everything else is printed.

Filters are set in the launching process before anything is imported that warns, and the ranks forked from it inherit
them; ranks started as fresh interpreters (GPU jobs) run the same entry point, which sets them again.
"""

from __future__ import annotations

import logging
import warnings

#: (message pattern, category, why it is harmless here)
KNOWN_HARMLESS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     "Lightning's own copy of torch's tree flattening (lightning.pytorch.utilities._pytree) builds a LeafSpec; torch "
     "2.13 deprecates the class, and the flattening it does is unchanged"),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning,
     "DeepSpeed's ZeRO gathers call it; torch 2.13 renamed the collective (all_gather_single) and runs the same one"),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning,
     "DeepSpeed's ZeRO-3 gradient partitioning calls it; torch 2.13 renamed the collective (reduce_scatter_single) "
     "and runs the same one"),
    (r"Your `IterableDataset` has `__len__` defined", UserWarning,
     "Lightning warns of any sized IterableDataset in case several loader workers duplicate its data; the package's "
     "loaders (lightning_mgpu.data.tokens) read in the rank's own process (num_workers=0), each rank its own slice"),
)


#: Lightning's info lines that are not about the run: (start of the message, why it is left out)
KNOWN_ADVERTISEMENTS = (
    ("💡 Tip: For seamless cloud logging", "Lightning advertises its hosted logger (litlogger) at every Trainer's "
     "creation, once per rank; mgpu-train's loggers are chosen with logger="),
)
#: The loggers Lightning's ``rank_zero_info`` writes to (the one of lightning.pytorch, or of lightning.fabric).
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _not_an_advertisement(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(tuple(start for start, _why in KNOWN_ADVERTISEMENTS))


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_HARMLESS` and :data:`KNOWN_ADVERTISEMENTS` (in this process and the ranks it forks)."""
    for pattern, category, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _not_an_advertisement not in logger.filters:
            logger.addFilter(_not_an_advertisement)
