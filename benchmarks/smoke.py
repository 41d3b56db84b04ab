"""The smoke mode of every benchmark: ``--smoke`` on a script's command line picks tiny sizes and one round, so that
``make test`` (``tests/benchmarks``) runs each in seconds and none can rot. It asserts only that the script finishes
and prints its figure; a smoke figure measures nothing."""

from __future__ import annotations

import sys
from typing import TypeVar

T = TypeVar("T")

#: Whether this script was started with ``--smoke``.
SMOKE = "--smoke" in sys.argv[1:]


def sized(full: T, smoke: T) -> T:
    """``smoke`` in the smoke mode, else ``full``."""
    return smoke if SMOKE else full
