"""How far fp8 on each layout drifts from fp8 on one process over a long curve, beside the same layout without fp8.

fp8's first step on every layout equals one process (``tests/distributed/test_fp8.py``). After it the runs part: fp8's
rounding is a step function of its input, so a layout's fp32 reduction-order difference (1e-7: a row-parallel layer
sums its partial products after the matmul, data-parallel ranks reduce gradients in another order) flips some
roundings once the weights have moved. This script measures that drift: the tiny Llama (and its mixture of experts for
ep2), fp8 emulated on CPU over a ``32-true`` base, two processes a layout, the same micro-batches as one process,
``STEPS`` steps with the learning rate's cosine over the whole run. Per layout it prints |loss - one process| at steps
1 and 2, the largest in the first 10 steps and over all steps, the last step's, the first step more than 1e-5 off,
the same for the gradient norm at step 1 and over all steps, and the same layout without fp8 against one process
without fp8 (the fp32 reduction order alone); then fp8's own effect (one process with fp8 against without) as the
scale the drift is read against. Every figure is the larger of the two ranks'.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny models, the data and fit()

from helpers import GLOBAL_BATCH, OPTIM, TINY, fit, make_token_file  # noqa: E402
from moe_helpers import TINY_MOE  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

from lightning_mgpu import LLMModule, MGPUPrecision  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402

STEPS = sized(100, 2)
#: Four blocks: the schedules with two stages a rank need a layer per stage.
DEEP = dataclasses.replace(TINY, n_layers=4)
#: (name, model, recipe, strategy arguments), each on two processes
LAYOUTS = sized([("tp2", TINY, "rowwise", dict(tensor_parallel_size=2)),
                 ("tp2 + SP", TINY, "rowwise", dict(tensor_parallel_size=2, sequence_parallel=True)),
                 ("cp2", TINY, "rowwise", dict(context_parallel_size=2)),
                 ("pp2 1F1B", TINY, "rowwise", dict(pipeline_parallel_size=2)),
                 ("pp2 ZBV", DEEP, "rowwise", dict(pipeline_parallel_size=2, pipeline_schedule="zbv",
                                                   virtual_pipeline_size=2)),
                 ("dp2 ZeRO-1", TINY, "rowwise", dict(zero_stage=1)),
                 ("dp2 ZeRO-3", TINY, "rowwise", dict(zero_stage=3)),
                 ("ep2 (MoE)", TINY_MOE, "rowwise", dict(expert_parallel_size=2)),
                 ("tp2 tensorwise", TINY, "tensorwise", dict(tensor_parallel_size=2))],
                [("tp2", TINY, "rowwise", dict(tensor_parallel_size=2))])
MODEL_NAMES = {id(TINY): "tiny", id(DEEP): "deep", id(TINY_MOE): "moe"}


def train(rank: int, token_file: Path, devices: int, model, recipe, kw: dict) -> dict:
    """One run of ``STEPS`` steps; ``recipe=None``: without fp8."""
    module = LLMModule(model, **dict(OPTIM, max_steps=STEPS), global_batch_size=GLOBAL_BATCH)
    out = fit(rank, token_file, devices, max_steps=STEPS, model=model, module=module,
              check_layout=model is not TINY_MOE, precision_plugin=MGPUPrecision("32-true", fp8=recipe), **kw)
    return {"losses": out["losses"], "grad_norms": out["grad_norms"]}


def runs(rank: int, token_file: Path, devices: int, todo: list) -> dict:
    """Every run of ``todo`` (key, model, recipe, strategy arguments) in this one launch."""
    return {key: train(rank, token_file, devices, model, recipe, kw) for key, model, recipe, kw in todo}


def diffs(got: dict, want: dict, key: str = "losses") -> list[float]:
    """Per step, the largest |got - want| over the ranks (``got``: one result per rank, or one result)."""
    got = got if isinstance(got, list) else [got]
    return [max(abs(r[key][i] - w) for r in got) for i, w in enumerate(want[key])]


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        token_file = make_token_file(Path(directory))
        singles = {(MODEL_NAMES[id(m)], r) for _, m, r, _ in LAYOUTS} | {(MODEL_NAMES[id(m)], None) for _, m, _, _ in
                                                                         LAYOUTS}
        by_name = {"tiny": TINY, "deep": DEEP, "moe": TINY_MOE}
        ref = run_distributed(runs, 1, token_file, 1, [((m, r), by_name[m], r, {}) for m, r in sorted(
            singles, key=str)], timeout=7200)[0]
        todo = [((name, r), model, r, kw) for name, model, recipe, kw in LAYOUTS for r in (recipe, None)]
        ranks = run_distributed(runs, 2, token_file, 2, todo, timeout=7200)
    print(f"fp8 (emulated, 32-true base) on each layout against one process, {STEPS} steps, tiny Llama, "
          f"2 processes; |loss - one process|:")
    print("| layout | recipe | step 1 | step 2 | max, steps 1-10 | max, all steps | last step | first step > 1e-5 "
          "| grad norm: step 1 | grad norm: max, all steps | without fp8: max, all steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, model, recipe, _ in LAYOUTS:
        m = MODEL_NAMES[id(model)]
        fp8, fp32 = [r[(name, recipe)] for r in ranks], [r[(name, None)] for r in ranks]
        d, plain = diffs(fp8, ref[(m, recipe)]), diffs(fp32, ref[(m, None)])
        norms = diffs(fp8, ref[(m, recipe)], "grad_norms")
        parted = next((str(i + 1) for i, x in enumerate(d) if x > 1e-5), "none")
        print(f"| {name} | {recipe} | {d[0]:.1e} | {d[1]:.1e} | {max(d[:10]):.1e} | {max(d):.1e} | {d[-1]:.1e} "
              f"| {parted} | {norms[0]:.1e} | {max(norms):.1e} | {max(plain):.1e} |")
    for m, r in sorted({(MODEL_NAMES[id(m)], r) for _, m, r, _ in LAYOUTS}):
        own = diffs(ref[(m, r)], ref[(m, None)])
        print(f"fp8's own effect, one process, {m} {r}: |loss with fp8 - without| max {max(own):.1e}, "
              f"last step {own[-1]:.1e} (loss {ref[(m, r)]['losses'][-1]:.4f})")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "fp8 on each layout over 100 steps", about=__doc__):
        main()
