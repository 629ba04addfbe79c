"""What a forward pass costs: the curves that price a step's width, measured once and kept on disk.

A step over one sequence of k new tokens costs T(k) seconds (:class:`CostCurve`); a step over a
batch of B sequences of k new tokens each, after C cached columns per sequence, costs T_B(k, C)
(:class:`BatchCosts`). :func:`cost_curve` and :func:`batch_curve` time a few forward passes
(:func:`measure`) once per model, device, dtype and thread count (:func:`curve_key`) and keep the
curves in ``$LOOKAHEAD_CACHE/cost-curves.json``: every process reads back the same curves, so
every process takes the same steps. What the passes run is the caller's (``make_step``: the
model's own, ``lookahead.calibration``); what the curves decide is ``lookahead.tuning``'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ._files import locked
from .attention_switch import leave_cudnn_out
from .quantization import scheme

logger = logging.getLogger(__name__)

# token counts at which T is measured: every count up to 8, where a lone sequence's drafts of up to
# 7 tokens run and where a CPU's kernels change their shape (fp32 on this 2-core CPU: T(3)/T(1) =
# 1.12, T(4)/T(1) = 1.54, so 3 read between 2 and 4 was priced at 1.29), then sparser
GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 128)


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward pass over ``tokens`` new tokens: linear between measured points,
    extrapolated from the last two beyond them (flat where they fall)."""

    points: tuple[tuple[int, float], ...]  # (tokens, seconds), increasing tokens

    @classmethod
    def from_points(cls, points) -> CostCurve:
        """A curve from a CostCurve or (tokens, seconds) pairs: at least two, tokens increasing
        from 1, seconds positive."""
        if isinstance(points, CostCurve):
            return points
        try:
            pts = tuple((int(k), float(s)) for k, s in points)
        except (TypeError, ValueError) as err:
            raise ValueError(f"cost_curve must be (tokens, seconds) pairs, got {points!r}") from err
        if len(pts) < 2 or pts[0][0] != 1 or any(b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
            raise ValueError(
                "cost_curve needs at least two points, tokens increasing from 1, e.g. [(1, 0.02), (8, 0.03)]"
            )
        if any(not math.isfinite(s) or s <= 0 for _, s in pts):
            raise ValueError("cost_curve seconds must be positive and finite")
        return cls(pts)

    def __call__(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + max(0.0, y1 - y0) * (tokens - x1) / (x1 - x0)  # never falling past the last point

    def ratio(self, k: int, batch: int = 1) -> float:
        """T(batch * k) / T(batch): the cost of a k-token step relative to a plain one."""
        return self(batch * k) / self(batch)


def measure(step: Callable[[int], None], counts: Sequence[int] = GRID, pairs: int = 3) -> CostCurve:
    """Time ``step(k)`` (one forward pass over k new tokens, state restored after) for each k.

    After one warm-up pass per k, ``pairs`` pairs of rounds time every k once in increasing order,
    then once in decreasing order: within a pair, a machine that slows down or speeds up steadily
    (frequency, a neighbour's load) adds as much to every k's summed time, so the pair's ratio
    T(k)/T(1) is the sum of k's two timings over the sum of the first count's two. T(k) is the
    median of the pairs' ratios times the median timing of the first count: one slow spell moves
    one pair, not the curve. Never decreasing in k."""
    _warn_if_busy()
    for k in counts:
        step(k)
    seconds: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(pairs):
        for order in (counts, counts[::-1]):
            for k in order:
                start = time.perf_counter()
                step(k)
                seconds[k].append(time.perf_counter() - start)
    first = seconds[counts[0]]
    unit = statistics.median(first)
    points, floor = [], 0.0
    for k in counts:
        mine = seconds[k]
        ratios = [(mine[i] + mine[i + 1]) / (first[i] + first[i + 1]) for i in range(0, len(mine), 2)]
        floor = max(floor, unit * statistics.median(ratios))
        points.append((k, floor))
    return CostCurve(tuple(points))


# a 1-minute load average above this many runnable threads per core, before a curve is timed, says
# that other work shares the machine (this process's own threads account for at most one a core)
BUSY_PER_CORE = 1.5


def _warn_if_busy() -> None:
    """Log a warning where other work seems to load the machine: a curve timed then is kept, and
    prices every later call (on a 2-core CPU, one timed beside another job put a one-token step at
    4x its cost). The load average lags by up to a minute, so this catches steady work only."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return
    if load > BUSY_PER_CORE * cores:
        logger.warning(
            "timing a cost curve while the machine looks busy (1-minute load average %.1f on %d cores): "
            "it is kept and prices every later call; run `lookahead calibrate` once the machine is idle",
            load,
            cores,
        )


_curves: dict[tuple, CostCurve] = {}


def _disk_path() -> Path:
    from .models import cache_dir

    return cache_dir() / "cost-curves.json"


def cost_curve(model, make_step: Callable[[], Callable[[int], None]]) -> CostCurve:
    """The model's cost curve on its device and dtype, measured once and then kept on disk.

    The curve decides step shapes, and in bf16 a step's shape can tip a near-tie (greedy or
    sampled), so it is read back rather than re-timed: every process takes the same steps. It is
    keyed by what decides a forward pass's cost: the architecture (a hash of the config, weights
    aside), device, dtype and thread count, in
    ``$LOOKAHEAD_CACHE/cost-curves.json``. ``make_step()`` returns a function running one forward
    pass over k tokens (see :func:`measure`); it is only called when no curve is known yet.
    """
    key = curve_key(model)
    if key in _curves:
        return _curves[key]
    curve = _stored(key)
    if curve is None:
        start = time.perf_counter()
        curve = measure(make_step())
        logger.info("cost curve of %s measured in %.2f s: %s", key, time.perf_counter() - start, curve.points)
        _write_disk(key, curve)
    _curves[key] = curve
    return curve


# how the curve was timed: bumped when a change to the calibration makes stored curves wrong, so
# that they are measured again (2: without autograd; curves of `lookahead bench` and `lookahead
# serve` on a fresh cache had been timed with it; 3: GRID counts every token count up to 8, where
# version 2 read 3, 5, 6 and 7 off straight lines between its points)
CALIBRATION = "calibration-3"


def curve_key(model) -> str:
    """What decides the cost of a forward pass: architecture, device, dtype, threads, and how it was
    timed (``CALIBRATION``); for quantized weights their scheme (``lookahead.quantization.scheme``:
    their kernels have another cost curve, and weights quantized after loading leave the config as
    it was); on CUDA also
    whether wide steps leave cuDNN attention out (``attention_switch.leave_cudnn_out``: a curve stored when
    they did not was timed on another kernel)."""
    config = model.config.to_dict()
    shape = {k: v for k, v in config.items() if not k.startswith("_") and k not in _NOT_SHAPE}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    dtype = next(model.parameters()).dtype
    model_type = getattr(model.config, "model_type", type(model).__name__)
    key = f"{model_type}-{digest}|{model.device}|{dtype}|{torch.get_num_threads()}|{CALIBRATION}"
    quantized = scheme(model)
    if quantized is not None:
        key += f"|weights {quantized}"
    if model.device.type == "cuda":
        key += "|no-cudnn-masked" if leave_cudnn_out() else "|sdpa-as-set"
    return key


# config entries that name or describe a checkpoint without changing what a forward pass computes
_NOT_SHAPE = {"name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"}


def _read_disk() -> dict:
    try:
        return json.loads(_disk_path().read_text())
    except (OSError, ValueError):
        return {}


def _curve_from(points) -> CostCurve:
    """A curve from its points as stored on disk ([tokens, seconds] pairs)."""
    return CostCurve(tuple((int(k), float(s)) for k, s in points))


def _stored(key: str) -> CostCurve | None:
    """The curve stored on disk under ``key``, or None."""
    stored = _read_disk().get(key)
    return _curve_from(stored) if stored else None


def stored_curves(model) -> dict[str, CostCurve]:
    """The curves stored on disk for ``model`` on its device, dtype and thread count: its own
    (under :func:`curve_key`) and each batch's (:func:`batch_curve`), by key."""
    own = curve_key(model)
    return {key: _curve_from(points) for key, points in _read_disk().items() if key == own or _batch_of(key, own)}


def _batch_of(key: str, model_key: str) -> bool:
    """Whether ``key`` stores one of the batch curves of the model whose key is ``model_key``."""
    shape = batch_shape(key)
    return shape is not None and key == batch_key(model_key, *shape)


def forget(keys: Sequence[str]) -> None:
    """Remove the curves stored under ``keys``, on disk and in this process: the next call that
    needs one measures it again."""
    for key in keys:
        _curves.pop(key, None)
    path = _disk_path()
    with locked(path.with_suffix(".lock")):
        data = _read_disk()
        if not any(key in data for key in keys):
            return
        for key in keys:
            data.pop(key, None)
        _replace_disk(path, data)


def _write_disk(key: str, curve: CostCurve) -> None:
    try:
        path = _disk_path()
        with locked(path.with_suffix(".lock")):  # another process may be adding its own key
            data = _read_disk()
            data[key] = [list(p) for p in curve.points]
            _replace_disk(path, data)
    except OSError as err:  # a read-only cache only costs a re-measurement next time
        logger.debug("could not store the cost curve: %s", err)


def _replace_disk(path: Path, data: dict) -> None:
    """Write the stored curves whole, through a file of this process's own (called with the lock
    held): a reader sees the old file or the new one, never half of one."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# tokens per sequence at which a batch's step cost is measured, as far as its widest step needs
ROW_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# cache lengths (columns per sequence) after which a batch's step cost is measured
BATCH_CONTEXTS = (64, 512)


def batch_sizes_to_measure(batch: int) -> list[int]:
    """The batch sizes whose measured costs price the steps of a batch of up to ``batch``
    sequences: powers of two from 2 to the first one >= ``batch`` (sizes between two of them are
    interpolated, see :class:`BatchCosts`)."""
    sizes = [2]
    while sizes[-1] < batch:
        sizes.append(2 * sizes[-1])
    return sizes


@dataclass(frozen=True)
class BatchCosts:
    """What a batch's step of k new tokens per sequence costs relative to its plain step,
    T_B(k, C) / T_B(1, C) after C cached columns per sequence, measured at a few batch sizes B
    and cache lengths C (:func:`batch_curve`).

    Read off the single-sequence curve, a batch's step would cost T(B * k) / T(B), as if its
    sequences' rows were one sequence of B * k tokens after a short context. They are not: on a
    2-core CPU in bf16 (SmolLM2, a batch of 8) a 2-token step costs 1.13x a plain one after 64
    cached tokens and 1.42x after 512, where T(16) / T(8) says 1.04; a 4-token step 1.23x and
    1.47x where T(32) / T(8) says 1.15. Every sequence attends over the whole cache under its own
    mask, so wide steps grow dearer with B and C. A batch priced by the single curve ran wide
    steps that lost (0.96x greedy on MT-bench at a batch of 8).

    Seconds are linear in C between (and beyond) the measured cache lengths, never falling as C
    grows, and held below the shortest; the ratio (at least 1) is then interpolated linearly in B
    between two measured batch sizes (B = 1 is the single curve, which has one context); beyond
    the largest, the largest's ratio holds."""

    single: CostCurve
    # (batch size, ((cache length, curve over tokens per sequence), ...)), both increasing
    by_batch: tuple[tuple[int, tuple[tuple[int, CostCurve], ...]], ...]

    def ratio(self, k: int, batch: int, context: int = 0) -> float:
        known = [(1, None), *self.by_batch]
        for (b0, low), (b1, high) in zip(known, known[1:], strict=False):
            if batch <= b1:
                r0 = self.single.ratio(k) if low is None else self._ratio_at(low, k, context)
                r1 = self._ratio_at(high, k, context)
                return r0 + (r1 - r0) * (max(batch, b0) - b0) / (b1 - b0)
        return self._ratio_at(known[-1][1], k, context)

    def seconds(self, k: int, batch: int, context: int = 0) -> float:
        """T_B(k, C) itself: linear in C as above, then linear in B between the measured sizes
        (B = 1: the single curve), the largest's beyond them (what a replay bills a step)."""
        known = [(1, None), *self.by_batch]
        for (b0, low), (b1, high) in zip(known, known[1:], strict=False):
            if batch <= b1:
                s0 = self.single(k) if low is None else self._seconds_at(low, k, context)
                return s0 + (self._seconds_at(high, k, context) - s0) * (max(batch, b0) - b0) / (b1 - b0)
        return self._seconds_at(known[-1][1], k, context)

    @staticmethod
    def _seconds_at(curves: tuple[tuple[int, CostCurve], ...], k: int, context: int) -> float:
        (c0, near), (c1, far) = curves[0], curves[-1]
        if c1 == c0 or context <= c0:
            return near(k)
        return near(k) + max(0.0, far(k) - near(k)) * (context - c0) / (c1 - c0)

    @classmethod
    def _ratio_at(cls, curves: tuple[tuple[int, CostCurve], ...], k: int, context: int) -> float:
        return max(1.0, cls._seconds_at(curves, k, context) / cls._seconds_at(curves, 1, context))


def batch_key(model_key: str, batch: int, context: int) -> str:
    """Where a batch's curve is stored: after the model's own :func:`curve_key`."""
    return f"{model_key}|batch-{batch}|context-{context}"


_BATCH_KEY = re.compile(r"\|batch-(\d+)\|context-(\d+)$")


def batch_shape(key: str) -> tuple[int, int] | None:
    """(batch, context) of a key made by :func:`batch_key`; None for any other key."""
    found = _BATCH_KEY.search(key)
    return (int(found[1]), int(found[2])) if found else None


def batch_curve(
    model, batch: int, context: int, rows: int, make_step: Callable[[], Callable[[int], None]]
) -> CostCurve:
    """Seconds per forward pass over ``batch`` sequences of k new tokens each after ``context``
    cached columns, for k on ``ROW_GRID`` up to the first count >= ``rows``: measured once
    (:func:`measure`) and kept on disk beside the single-sequence curve, as that one is, so that
    every process prices a batch alike. A wider setting later measures only the counts it adds,
    and keeps the stored ones. ``make_step()`` returns a function running one such pass."""
    key = batch_key(curve_key(model), batch, context)
    need = next((k for k in ROW_GRID if k >= rows), ROW_GRID[-1])
    curve = _curves.get(key) or _stored(key)
    if curve is None or curve.points[-1][0] < need:
        known = {k for k, _ in curve.points} if curve is not None else set()
        counts = [k for k in ROW_GRID if k <= need and k not in known]
        start = time.perf_counter()
        fresh = measure(make_step(), counts=tuple(counts) if counts[0] == 1 else (1, *counts))
        if curve is None:
            curve = fresh
        else:  # the new counts in the stored curve's units, never below its last point
            scale, points, floor = curve(1) / fresh(1), list(curve.points), curve.points[-1][1]
            for k, seconds in fresh.points:
                if k in counts:
                    floor = max(floor, seconds * scale)
                    points.append((k, floor))
            curve = CostCurve(tuple(points))
        logger.info("batch cost curve of %s measured in %.2f s: %s", key, time.perf_counter() - start, curve.points)
        _write_disk(key, curve)
    _curves[key] = curve
    return curve
