"""The warnings and log lines other libraries print while the package drives them, that say nothing a user can act
on and are known to be harmless here (the reason stands beside each filter). Every rank sets the filters as its process
group starts (``lightning_mgpu.parallel.process_group``), so a user's own ``Trainer(strategy=MGPUStrategy(...))``
script prints none of them, nor does ``mgpu-train``; everything else is printed.
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

#: (logger, part of the message, why it is harmless here)
KNOWN_HARMLESS_LOGS = (
    ("DeepSpeed", "You are using ZeRO with an untested optimizer",
     "the optimizer is the user's own (configure_optimizers): DeepSpeed's ZeRO wraps any torch optimizer, the engine's "
     "config allows it (zero_allow_untested_optimizer), and DeepSpeed warns of every class outside its short list"),
)


def _harmless_log(record: logging.LogRecord) -> bool:
    """False for a record of :data:`KNOWN_HARMLESS_LOGS` (a logging filter keeps a record it returns True for)."""
    return not any(record.name == name and part in str(record.msg) for name, part, _why in KNOWN_HARMLESS_LOGS)


def quiet_library_warnings() -> None:
    """Filter :data:`KNOWN_HARMLESS` and :data:`KNOWN_HARMLESS_LOGS` in this process and the ranks it forks (calling
    it again adds nothing)."""
    for pattern, category, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in {name for name, _part, _why in KNOWN_HARMLESS_LOGS}:
        logger = logging.getLogger(name)
        if _harmless_log not in logger.filters:
            logger.addFilter(_harmless_log)
