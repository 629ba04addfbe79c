"""Auto-tuning: how wide each step should be, from the model's cost curve and the acceptance seen.

**The model of the choice.** A step over one sequence of k input tokens costs T(k) seconds,
against T(1) for a plain one-token step; a step over a batch of B sequences of k tokens each
costs T_B(k, C) after C cached columns per sequence, against T_B(1, C). Verifying g candidates of
n-1 tokens (plus, when W > 0, the window's rows) makes k = ``build_layout(...).length`` tokens per
sequence, and a sequence then emits 1 + a tokens, where a is the longest prefix of the first g
candidates that the model agrees with, capped at n-1. So the expected speed of the setting
(g, n), relative to plain decoding, is

    rate(g, n) = E[1 + min(n - 1, max_{i <= g} a_i)] * T_B(1, C) / T_B(k(g, n), C)

and plain decoding has rate 1. T comes from ``lookahead.costs.cost_curve``, measured once per
model, device, dtype and thread count (a few forward passes over 1 to 128 tokens, ``costs.GRID``,
kept in ``$LOOKAHEAD_CACHE/cost-curves.json`` so that every process decides alike; or given by the
user); T_B from ``costs.batch_curve``, measured as T is at a few batch sizes and cache lengths
(``costs.BatchCosts``), or, where the user gave T, read off it as T(B * k) / T(B).

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

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .costs import BatchCosts, CostCurve
from .layout import build_layout


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
        of the candidates at hand, see ``lookahead.planning.step_sizes``), else :meth:`rows`."""
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
