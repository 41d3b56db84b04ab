"""Run benchmark scripts in their smoke mode one after the other in this one process (torch, Lightning and DeepSpeed
are imported once for all of them), each as ``python SCRIPT --smoke`` would run it, framed by marker lines:
``=== start SCRIPT`` and ``=== end SCRIPT exit CODE``, then the seconds it took. A script that raises prints its traceback and exits 1; the
next one still runs."""

import runpy
import sys
import time
import traceback
from pathlib import Path

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # before any tensor work: a forked rank deadlocks on a parent's OpenMP pool
    from lightning_mgpu.engine import preload
    from lightning_mgpu.testing import use_free_port_for_lightning

    use_free_port_for_lightning()  # ports out of the kernel's ephemeral range, this pytest worker's share
    # DeepSpeed and the modules its engines import, once here: every rank the scripts fork inherits them instead of
    # importing them itself (about 6 s of CPU a rank, as tests/conftest.py does for the suite's own ranks)
    preload()
    for path in sys.argv[1:]:
        print(f"=== start {Path(path).name}", flush=True)
        start = time.perf_counter()
        sys.argv = [path, "--smoke"]
        sys.path.insert(0, str(Path(path).parent))
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            code = 1
        finally:
            sys.path.pop(0)
        print(f"=== end {Path(path).name} exit {code}", flush=True)
        print(f"({Path(path).name}: {time.perf_counter() - start:.1f} s)", flush=True)
