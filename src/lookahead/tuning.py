"""Auto-tuning: how wide each step should be, from the model's cost curve and the acceptance seen.

**The model of the choice.** A step over one sequence of k input tokens costs T(k) seconds,
against T(1) for a plain one-token step; a step over a batch of B sequences of k tokens each
costs T_B(k, C) after C cached columns per sequence, against T_B(1, C). Verifying g candidates of
n-1 tokens (plus, when W > 0, the window's rows) makes k = ``build_layout(...).length`` tokens per
sequence, and a sequence then emits 1 + a tokens, where a is the longest prefix of the first g
candidates that the model agrees with, capped at n-1. So the expected speed of the setting
(g, n), relative to plain decoding, is

    rate(g, n) = E[1 + min(n - 1, max_{i <= g} a_i)] * T_B(1, C) / T_B(k(g, n), C)

and plain decoding has rate 1. T comes from :func:`cost_curve`, measured once per model, device,
dtype and thread count (a few forward passes over 1 to 128 tokens, ``GRID``, kept in
``$LOOKAHEAD_CACHE/cost-curves.json`` so that every process decides alike; or given by the user);
T_B from :func:`batch_curve`, measured as T is at a few batch sizes and cache lengths
(:class:`BatchCosts`), or, where the user gave T, read off it as T(B * k) / T(B).

The expectation is taken over the last ``memory`` observations: after every wide step, each row
reports the matched prefix a_i of every candidate it verified (read off the step's logits,
accepted or not), so one wide step informs every narrower setting. Observations are kept apart
by the length of the context's longest suffix seen earlier in the text (0-3,
``lookup.ContextIndex.match_length``): after a repeated 3-token suffix the first candidate is
usually right, after a new token rarely, so the same rule picks a wide step in the first case
and a plain one in the second (prompt lookup decoding hard-codes a version of this). A match
length's own mean is drawn towards the mean of all observations with the weight of ``prior``
(2) observations, so a first success after a longer repeated suffix already counts. In a batch,
the expectation is the mean over its rows, weighted where the caller says what each row's tokens
are worth (``generate`` waits for its last sequence: ``lookahead.engine.Engine._weights``).

For a single sequence, k(g, n) is the size of the step it would really run: its candidates
merged into a token tree (shared prefixes cost one row, see ``lookahead.layout``); an option with
no candidate at hand expects one token, and without a window it runs as a plain step.

The chooser runs the setting with the highest rate, including plain steps; every
``probe_every`` steps it runs a probe (the widest setting that could pay nearly most were every
candidate token accepted) to keep the observations fresh, never more often than keeps a losing
probe's extra cost under ``probe_overhead`` (10%) of plain decoding; while probes keep losing
the interval doubles (up to ``max_interval``), separately for each match length, so that text
turning repetitive is probed again soon. The output never depends on the choice: only the speed
does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._files import locked
from .layout import build_layout
from .runner import leave_cudnn_out

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
    timed (``CALIBRATION``); on CUDA also
    whether wide steps leave cuDNN attention out (``runner.leave_cudnn_out``: a curve stored when
    they did not was timed on another kernel)."""
    config = model.config.to_dict()
    shape = {k: v for k, v in config.items() if not k.startswith("_") and k not in _NOT_SHAPE}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    dtype = next(model.parameters()).dtype
    model_type = getattr(model.config, "model_type", type(model).__name__)
    key = f"{model_type}-{digest}|{model.device}|{dtype}|{torch.get_num_threads()}|{CALIBRATION}"
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


def _stored(key: str) -> CostCurve | None:
    """The curve stored on disk under ``key``, or None."""
    stored = _read_disk().get(key)
    return CostCurve(tuple((int(k), float(s)) for k, s in stored)) if stored else None


def _write_disk(key: str, curve: CostCurve) -> None:
    try:
        path = _disk_path()
        with locked(path.with_suffix(".lock")):  # another process may be adding its own key
            data = _read_disk()
            data[key] = [list(p) for p in curve.points]
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
    except OSError as err:  # a read-only cache only costs a re-measurement next time
        logger.debug("could not store the cost curve: %s", err)


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


def batch_curve(
    model, batch: int, context: int, rows: int, make_step: Callable[[], Callable[[int], None]]
) -> CostCurve:
    """Seconds per forward pass over ``batch`` sequences of k new tokens each after ``context``
    cached columns, for k on ``ROW_GRID`` up to the first count >= ``rows``: measured once
    (:func:`measure`) and kept on disk beside the single-sequence curve, as that one is, so that
    every process prices a batch alike. A wider setting later measures only the counts it adds,
    and keeps the stored ones. ``make_step()`` returns a function running one such pass."""
    key = f"{curve_key(model)}|batch-{batch}|context-{context}"
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


def match_lengths(candidates: Sequence[Sequence[int]], first: int, choice: Callable[[int, int], int]) -> list[int]:
    """How many leading tokens of each candidate the model agrees with: ``first`` is its choice
    after t, ``choice(k, j)`` its choice after token j of candidate k. The candidates agreeing
    through token j share that prefix (the model's choices), so they all read the choice of the
    first of them, the one verification follows (``verify.verify_choices``)."""
    out = []
    first_with: dict[tuple[int, ...], int] = {}  # agreed prefix -> the first candidate with it
    for k, candidate in enumerate(candidates):
        matched, expected = 0, first
        for j, token in enumerate(candidate):
            if token != expected:
                break
            matched += 1
            leader = first_with.setdefault(tuple(candidate[: j + 1]), k)
            if j + 1 < len(candidate):
                expected = choice(leader, j)
        out.append(matched)
    return out


PLAIN = (0, 1)  # a one-token step: no candidates, no window
ALL = "all"  # the bucket of every observation, whatever its context's match length


@dataclass
class WidthChooser:
    """Picks (g, n) per step: g candidates of n - 1 tokens, or PLAIN. See the module docstring."""

    curve: CostCurve | None
    max_candidates: int
    ngram_size: int
    window_size: int = 0
    batch: int = 1
    enabled: bool = True
    probe_every: int = 8
    max_interval: int = 64
    memory: int = 128
    prior: float = 2.0  # weight, in observations, of all observations' mean in a match length's estimate
    probe_overhead: float = 0.1  # most of plain decoding's time that losing probes may add
    observations: deque = field(default_factory=deque)  # (match, cap, lengths) per row that verified candidates
    # tallies of the observations, kept as they come and go: _tally[bucket][g][v] = how many
    # observations in ``bucket`` (a match length, or ALL) give min(cap, best of the first g) = v
    _tally: dict = field(default_factory=dict)
    chosen: Counter = field(default_factory=Counter)  # (g, n) -> steps
    _since_probe: int = 0
    _interval: dict = field(default_factory=dict)  # probe back-off per match length (None: batches)
    _bucket: int | None = None  # the match length probes are judged for this step
    _observed: bool = False  # whether this step recorded an observation
    _step_probe: tuple[int, int] | None = None  # the probe setting as priced when this step was chosen
    _matches: list = field(default_factory=lambda: [None])
    _sizes: dict | None = None  # this step's input tokens per option, when the caller knows them
    _at_hand: list | None = None  # in a batch: candidates each sequence has at hand this step, when known
    _weights: list | None = None  # in a batch: what a token of each sequence is worth this step (None: alike)
    # what a batch's steps cost, measured over batch shapes (None: read off the single curve)
    batch_costs: BatchCosts | None = None
    context: int = 0  # columns per sequence in the cache this step (what batch_costs are priced at)

    def ratio(self, k: int) -> float:
        """The cost of a step of k input tokens per sequence relative to a plain one, for this
        step's batch: from the costs measured over batch shapes (``batch_costs``), at this step's
        cache length, else from the single-sequence curve."""
        if self.batch > 1 and self.batch_costs is not None:
            return self.batch_costs.ratio(k, self.batch, self.context)
        return self.curve.ratio(k, self.batch)

    @property
    def widest(self) -> tuple[int, int]:
        return (self.max_candidates, self.ngram_size)

    @property
    def probe(self) -> tuple[int, int]:
        """The setting that observations start from and refresh: the widest of those that could
        pay (nearly) most if every candidate token were accepted (n tokens for the cost of its
        rows). Where width is nearly free (GPUs) that is the widest setting; on a CPU a narrow
        one, since a wide probe that loses costs several plain steps."""
        potential = {c: c[1] / self.ratio(self.size(*c)) for c in self.options()}
        top = max(potential.values())
        return max(c for c, p in potential.items() if p >= 0.95 * top)  # the widest near the top

    def options(self) -> list[tuple[int, int]]:
        low = 0 if self.window_size else 1
        return [(g, n) for g in range(low, self.max_candidates + 1) for n in range(2, self.ngram_size + 1)]

    def rows(self, g: int, n: int) -> int:
        """Input tokens per row of a step with g candidates of n - 1 tokens (and the window)."""
        levels = self.ngram_size - 1 if self.window_size else 0
        return build_layout(1, self.window_size, levels, g, n - 1).length

    def size(self, g: int, n: int) -> int:
        """Input tokens per row of (g, n) this step: as the caller counted them (a token tree
        of the candidates at hand, see ``lookahead.sequences.step_sizes``), else :meth:`rows`."""
        if self._sizes is not None and (g, n) in self._sizes:
            return self._sizes[(g, n)][0]
        return self.rows(g, n)

    def available(self, g: int, n: int) -> int:
        """Candidates (g, n) would verify this step: at most g, fewer when fewer are at hand."""
        if self._sizes is not None and (g, n) in self._sizes:
            return self._sizes[(g, n)][1]
        if self._at_hand is not None:
            return min(g, max(self._at_hand, default=0))
        return g

    def expected_tokens(self, g: int, n: int, match: int | None = None) -> float:
        """Mean tokens a row emits with (g, n) when the context's longest earlier-seen suffix has
        length ``match``: the mean over that match length's observations, drawn towards the mean
        over all of them with the weight of ``prior`` observations (so one or two observations of
        a new match length already move it; many decide it alone)."""
        if g <= 0:
            return 1.0  # the window alone: its n-grams help later steps, not this one
        overall = self._tally.get(ALL)
        if overall is None or not overall[0]:
            return 1.0
        g = min(g, self.max_candidates)
        mean = self._mean(overall, g, n)
        bucket = self._tally.get(match) if match is not None else None
        if bucket is None or not bucket[0]:
            return mean
        return (self._mean(bucket, g, n) * bucket[0] + mean * self.prior) / (bucket[0] + self.prior)

    @staticmethod
    def _mean(bucket: list, g: int, n: int) -> float:
        return 1 + sum(min(n - 1, v) * c for v, c in enumerate(bucket[g])) / bucket[0]

    def _count(self, observation: tuple, sign: int) -> None:
        match, cap, lengths = observation
        for key in {match, ALL}:
            bucket = self._tally.get(key)
            if bucket is None:  # [observations, then per g = 1..G a list of counts by value]
                bucket = self._tally[key] = [0] + [[0] * self.ngram_size for _ in range(self.max_candidates)]
            bucket[0] += sign
            best = 0
            for g in range(1, self.max_candidates + 1):
                if g <= len(lengths):
                    best = max(best, lengths[g - 1])
                bucket[g][min(cap, best, self.ngram_size - 1)] += sign

    def rate(self, g: int, n: int, matches: Sequence[int | None] = (None,)) -> float:
        """Expected tokens per second relative to plain decoding (plain = 1), for rows whose
        contexts match earlier text as far as ``matches`` says."""
        return self._rate(g, n, matches, {})

    def _rate(self, g: int, n: int, matches: Sequence[int | None], memo: dict) -> float:
        """:meth:`rate`, with what several options of one step share (a size's cost ratio, the
        sequences' (candidates, match length) counts, an expectation) kept in ``memo``."""
        if (g, n) == PLAIN:
            return 1.0
        size = self.size(g, n)
        ratio = memo.get(("ratio", size))
        if ratio is None:
            ratio = memo["ratio", size] = self.ratio(size)
        have = self.available(g, n)
        if not have:
            return 1.0 / ratio
        # sequences share few (candidates, match length) pairs: each pair's expectation once,
        # weighted; a sequence with no candidate at hand emits one token, whatever the others verify
        counts = memo.get(("counts", have))
        if counts is None:
            hands = self._at_hand if self._at_hand is not None and len(self._at_hand) == len(matches) else None
            weights = self._weights if self._weights is not None and len(self._weights) == len(matches) else None
            counts = Counter()
            for b, m in enumerate(matches):
                counts[min(have, hands[b]) if hands else have, m] += weights[b] if weights else 1.0
            memo["counts", have] = counts
        expected = total = 0.0
        for (h, m), weight in counts.items():
            mean = memo.get(("expected", h, n, m))
            if mean is None:
                mean = memo["expected", h, n, m] = self.expected_tokens(h, n, m)
            expected += mean * weight
            total += weight
        return expected / total / ratio

    def best(self, matches: Sequence[int | None] = (None,)) -> tuple[int, int]:
        memo: dict = {}
        return max([PLAIN, *self.options()], key=lambda choice: self._rate(*choice, matches, memo))

    def choose(
        self,
        matches: Sequence[int | None] = (None,),
        sizes: dict | None = None,
        at_hand: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> tuple[int, int]:
        """The setting for the next step; ``matches[b]``: row b's longest earlier-seen suffix;
        ``sizes``: each option's input tokens per row this step, when known (see :meth:`size`);
        ``at_hand[b]``: in a batch, how many candidates sequence b has at hand (sequences with none
        emit one token: counting them as verifying would overrate wide steps); ``weights[b]``:
        what a token of sequence b is worth this step (default: alike, tokens per second; see
        ``lookahead.engine.Engine._weights``), so the rate is the weighted mean over the rows."""
        self._since_probe += 1
        self._matches = list(matches)
        self._sizes = sizes
        self._at_hand = list(at_hand) if at_hand is not None else None
        self._weights = list(weights) if weights is not None and sum(weights) > 0 else None
        # a probe is judged, and backed off, per match length: a repeated suffix where probes
        # lost before is no reason not to try after a longer one (a batch mixes them: one state)
        self._bucket = matches[0] if len(matches) == 1 else None
        self._observed = False
        tuned = self.enabled and self.curve is not None and (self.max_candidates > 0 or self.window_size > 0)
        probe = self._step_probe = self.probe if tuned else None  # priced once per step
        if not tuned:
            choice = self.widest
        elif not self.observations or self._since_probe >= max(
            self.probe_every, self._interval.get(self._bucket, 0), self._budget(probe)
        ):
            choice = probe  # observe first, then probe now and then
        else:
            choice = self.best(matches)
        if not self.window_size and choice != PLAIN and self.available(*choice) == 0:
            choice = PLAIN  # no candidate at hand: the step is a plain one, and counted as such
        if choice == self.widest or tuned and choice == probe:
            self._since_probe = 0
        self.chosen[choice] += 1
        return choice

    def _budget(self, probe: tuple[int, int]) -> int:
        """Steps between probes that keep a losing probe's extra cost within ``probe_overhead`` of
        plain decoding's time (a (1,4) probe costs 1.9 plain steps alone, 3.3 in a batch of 8)."""
        extra = self.ratio(self.size(*probe)) - 1.0
        return math.ceil(extra / self.probe_overhead)

    def record(self, choice: tuple[int, int], cap: int, lengths: Sequence[int], match: int | None = None) -> None:
        """One row's outcome of a step run with ``choice``: ``lengths`` are the matched prefixes
        of the candidates it verified, ``cap`` their length, ``match`` its context's suffix match."""
        if choice == PLAIN or not lengths:  # no candidate verified: nothing learnt about acceptance
            return
        observation = (match, cap, tuple(lengths))
        self._observed = True
        self.observations.append(observation)
        self._count(observation, 1)
        while len(self.observations) > self.memory * self.batch:
            self._count(self.observations.popleft(), -1)

    def after_step(self, choice: tuple[int, int]) -> None:
        """Back off, for this step's match length, while probes keep losing to plain decoding; a
        probe that verified no candidate (the window alone) observed nothing and is not judged."""
        if self.enabled and self.curve is not None and self._observed and choice == self._step_probe:
            paid = self.best(self._matches) != PLAIN
            interval = self._interval.get(self._bucket, 0)
            interval = 0 if paid else min(self.max_interval, 2 * max(interval, self.probe_every // 2))
            self._interval[self._bucket] = interval

    @property
    def wide_steps(self) -> int:
        return sum(count for choice, count in self.chosen.items() if choice != PLAIN)

    def summary(self) -> dict[str, int]:
        """Steps per setting, as "G=g,N=n" (or "plain") -> steps."""
        return {("plain" if c == PLAIN else f"G={c[0]},N={c[1]}"): n for c, n in sorted(self.chosen.items())}
