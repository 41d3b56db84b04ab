"""What fp8 computed in the first optimizer step of a run, in a form that does not depend on the layout: per layer
and per operand of its GEMMs, how often each scale (as a power of two) and each fp8 number (with its scale) occurred,
over every micro-batch and every rank.

A layout splits an operand (tensor parallelism: features; context parallelism: tokens; data and pipeline
parallelism: micro-batches and layers) or repeats a cast (a column-parallel layer's input on every tensor rank, a
scale reduced over a split on each of its ranks, a recomputed forward, a backward that a zero-bubble schedule runs
once for the input gradient and again for the weight gradient, a weight cast for each micro-batch). Each cast is kept
as a record of its counts of (scale exponent, fp8 number) pairs, and :func:`merged` keeps each distinct record once
over all casts and ranks before summing:
the union of a split operand's parts is the whole, a repeated cast counts once. Two runs' merged censuses are then
equal exactly when every scale and every fp8 number of the first step is (:func:`distance`)."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any, Callable

import lightning as L
import torch
from torchao.float8.float8_utils import EPS

#: ``model.layers.3.attention.wq``, ``model.0.layers.3.attention.wq`` (a pipeline stage) -> ``layers.3.attention.wq``
_LAYER = re.compile(r"(layers\.\d+\..*|output.*)$")


def canonical(name: str) -> str:
    match = _LAYER.search(name)
    return match.group(1) if match else name


class Fp8Census(L.Callback):
    """Counts, during the first optimizer step only, every scale and fp8 value the package's casts produce: the dense
    layers' (``lightning_mgpu.fp8.scaling.cast``) and the grouped experts' (``grouped.round_rows``/``round_weight``),
    by wrapping those functions in this process. ``out``: ``{(layer, operand): {"values": {record, ...}, "floor":
    the exponent of torchao's floor scale}}``, a record ``(((scale exponent, fp8 number's fp32 bits), count), ...)``
    per cast."""

    def __init__(self) -> None:
        self.out: dict = defaultdict(lambda: {"values": set(), "floor": 0})
        self.names: dict[int, str] = {}
        self.recording = False
        self._scale: Any = None
        self._originals: list = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from lightning_mgpu.fp8 import Fp8Linear, grouped, scaling
        from lightning_mgpu.fp8.grouped import Fp8Grouped

        for name, m in trainer.strategy.model.module.named_modules():
            if isinstance(m, Fp8Linear):
                self.names[id(m.fp8)] = canonical(name)
            elif isinstance(getattr(m, "matmul", None), Fp8Grouped):
                self.names.update({id(spec): f"{canonical(name)}.{w}" for w, spec in m.matmul.specs.items()})
            elif getattr(getattr(m, "linear", None), "func", None) is not None:
                self.names[id(m.linear.keywords["spec"])] = canonical(name)
        self._originals = [(scaling, "cast", scaling.cast), (grouped, "round_rows", grouped.round_rows),
                           (grouped, "round_weight", grouped.round_weight),
                           (grouped, "amax_to_scale", grouped.amax_to_scale)]
        scaling.cast = self._dense(scaling.cast)
        for stage in getattr(getattr(trainer.strategy, "pipeline", None), "stages", []):
            for inference in ("_forward_metadata_inference", "_backward_metadata_inference"):
                setattr(stage, inference, self._paused(getattr(stage, inference)))
        grouped.round_rows = self._grouped(grouped.round_rows, "rows")
        grouped.round_weight = self._grouped(grouped.round_weight, "weight")
        grouped.amax_to_scale = self._kept(grouped.amax_to_scale)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.recording = trainer.global_step == 0

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for owner, name, original in self._originals:  # the next run of this process wraps the originals again
            setattr(owner, name, original)
        self.out = {key: dict(v) for key, v in self.out.items()}

    def _count(self, key: tuple, scale: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> None:
        """``codes``: the fp8 numbers (value x scale); each counted with its scale's exponent, as a pair (the scales'
        census is these pairs' exponents: one per number, weighted by how many numbers a scale serves)."""
        entry = self.out[key]
        entry["floor"] = math.floor(math.log2(torch.finfo(dtype).max / EPS))
        exponents = torch.log2(scale.float()).round().long()
        pairs = torch.broadcast_to(exponents, codes.shape).flatten() * 2**32 + \
            codes.float().flatten().view(torch.int32).long() % 2**32
        entry["values"].add(tuple(((k >> 32, k % 2**32), n) for k, n in _counts(pairs)))

    def _dense(self, cast: Callable) -> Callable:
        def counted(t, cast_config, spec, role, axis, groups, mm_config):
            out = cast(t, cast_config, spec, role, axis, groups, mm_config)
            if self.recording and hasattr(out, "_scale"):
                self._count((self.names[id(spec)], role.name, axis), out._scale, out._data, cast_config.target_dtype)
            return out
        return counted

    def _grouped(self, rounding: Callable, kind: str) -> Callable:
        """The grouped experts' rounding: fp8 values held in fp32 (code / scale), the scale kept from the
        ``amax_to_scale`` call inside it."""
        def counted(t, cast_config, spec, axis, groups, *rest):
            self._scale = None
            out = rounding(t, cast_config, spec, axis, groups, *rest)
            if self.recording and self._scale is not None:
                operand = [f for f in dir(spec.config) if getattr(spec.config, f) is cast_config][0]
                self._count((self.names[id(spec)], kind, operand, axis), self._scale, out * self._scale,
                            cast_config.target_dtype)
            return out
        return counted

    def _paused(self, infer: Callable) -> Callable:
        """A pipeline stage's shape inference (torch's schedules run each stage's forward and backward once on made-up
        tensors before their first step): not counted."""
        def paused(*args, **kwargs):
            recording, self.recording = self.recording, False
            try:
                return infer(*args, **kwargs)
            finally:
                self.recording = recording
        return paused

    def _kept(self, amax_to_scale: Callable) -> Callable:
        def kept(*args, **kwargs):
            self._scale = amax_to_scale(*args, **kwargs)
            return self._scale
        return kept


def _counts(t: torch.Tensor) -> tuple:
    """``((value, count), ...)`` of ``t``, sorted: one cast's record, hashable."""
    values, counts = torch.unique(t, return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist()))


def merged(censuses: list[dict]) -> dict:
    """One census from every rank's: each distinct cast record once, then their counts summed."""
    records: dict = defaultdict(set)
    floors = {}
    for census in censuses:
        for key, entry in census.items():
            floors[key] = entry["floor"]
            records[key] |= entry["values"]
    out = {}
    for key, distinct in records.items():
        values: Counter = Counter()
        for record in distinct:
            values.update(dict(record))
        scales: Counter = Counter()
        for (exponent, _), n in values.items():
            scales[exponent] += n
        out[key] = {"floor": floors[key], "values": values, "scales": scales}
    return out


def _tv(a: Counter, b: Counter, shift: int, floor: int) -> float:
    """How much of two censuses' counts differ (0: equal, 1: disjoint): ``a`` (scale exponents, or (exponent, fp8
    number) pairs; the exponents moved by ``shift``) against ``b``, leaving out entries whose exponent is at or above
    ``floor``."""
    def kept(counts: Counter, by: int) -> Counter:
        out: Counter = Counter()
        for k, n in counts.items():
            e = (k[0] if isinstance(k, tuple) else k) + by
            if e < floor:
                out[(e, k[1]) if isinstance(k, tuple) else e] += n
        return out

    a, b = kept(a, shift), kept(b, 0)
    total = max(sum(a.values()), sum(b.values()))
    return sum(abs(a[v] - b[v]) for v in set(a) | set(b)) / (2 * total) if total else 0.0


def distance(got: dict, want: dict) -> dict[str, Any]:
    """Over operands, the largest share of two merged censuses' scales (``scales``) and (scale, fp8 number) pairs
    (``values``) that differ (:func:`_tv`): 0 when equal; an operand missing from either run counts 1.

    An output gradient may differ by one power of two for all its entries (``shifted``: those operands and the power):
    a layout that divides the loss by another number of micro-batches (data or context parallelism: a rank's own
    share, then a sum over ranks) hands the layers a gradient 2**k times one process's, which fp8 casts to the same
    numbers with scales 2**-k times as large. Except where the amax is below torchao's floor (``EPS``, 1e-12: a
    gradient that is zero but for rounding, such as the query's at a sequence's first token), whose scale stays at the
    floor's: entries whose scale is at the floor's exponent or above (``floor``) are left out of both runs."""
    worst: dict[str, Any] = {"scales": 0.0, "values": 0.0, "shifted": {}}
    empty = {"scales": Counter(), "values": Counter(), "floor": 0}
    for key in set(got) | set(want):
        a, b = got.get(key, empty), want.get(key, empty)
        if not (key in got and key in want):
            worst["scales"] = worst["values"] = 1.0
            continue
        shifts = range(-4, 5) if any("GRAD_OUTPUT" in str(part).upper() for part in key) else (0,)
        tv, shift = min((_tv(a["scales"], b["scales"], s, b["floor"]), abs(s), s) for s in shifts)[::2]
        worst["scales"] = max(worst["scales"], tv)
        worst["values"] = max(worst["values"], _tv(a["values"], b["values"], shift, b["floor"]))
        if shift:
            worst["shifted"][key] = shift
    return worst
