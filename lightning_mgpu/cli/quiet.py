"""The lines a run of ``mgpu-train`` does not print: the libraries' known harmless warnings, which the Python path
leaves out too (``lightning_mgpu.harmless_warnings``), and Lightning's advertisement, which only the command leaves
out (a user's own script keeps Lightning's own behaviour). The reason stands beside each filter.

Filters are set in the launching process before anything is imported that warns, and the ranks forked from it inherit
them; ranks started as fresh interpreters (GPU jobs) run the same entry point, which sets them again.
"""

from __future__ import annotations

import logging

from lightning_mgpu.harmless_warnings import quiet_library_warnings

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
    """Filter the libraries' known harmless warnings (``lightning_mgpu.harmless_warnings``) and
    :data:`KNOWN_ADVERTISEMENTS` (in this process and the ranks it forks)."""
    quiet_library_warnings()
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _not_an_advertisement not in logger.filters:
            logger.addFilter(_not_an_advertisement)
