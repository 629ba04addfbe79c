"""Draft chains for an engine that verifies a batch of requests at once (vLLM's custom proposer).

The engine calls :meth:`ChainProposer.propose` after every step with each *row* of its batch (a
slot, not a request: rows are reordered and condensed as requests come and go, and no request id
is given): the row's text (prompt and output so far) and the tokens the step just emitted there
(the accepted draft tokens, then the bonus token). It returns one draft per row, a linear chain
of at most ``max_draft`` tokens ([] for none), which the next step verifies.

Per request, the drafter is this project's count drafter (:class:`lookahead.drafting.TreeDrafter`)
cut to one candidate: the best chain of its trie. Its sources are the earlier occurrences of the
context's repeated suffix in the request's own text (:class:`lookahead.lookup.ContextIndex`) and
the warm pool (:class:`lookahead.pool.SharedPool`: the texts of requests that left the batch),
and it learns its rates from what the engine emitted after each draft.

**Finding a request's state.** A request's state is keyed by its text: (its length, its first and
last ``KEY_TOKENS`` tokens). A row whose text now has n tokens, m of them just emitted, continues
the state stored under the key of its first n - m tokens; that state is then stored under its key
at n. So state follows the text wherever its row moves. Rows holding identical texts share a key
and each takes one of the states stored under it (they are interchangeable).

**What a draft costs.** The engine's own step time, learnt online (:class:`StepCosts`): the time
from the end of one call to the start of the next is the engine's step over the rows of the
second call, each verifying 1 + the draft proposed for it, when every row continues a row of the
first call (a new request's prefill would make it another step). It is kept by the tokens the step
verified, rows + drafted tokens: a row and a drafted token each add one position to the step, so
plain steps at 16 rows and a lone request's 15-token draft time the same point, and every step
the batch takes teaches the one curve. A row's draft of k tokens makes the step cost T(n + k)
instead of T(n), where n is the rows plus what the rows before it drafted, and it delays every
row's tokens: it pays when the tokens it is expected to add exceed the batch's expected tokens
times the step's relative slowdown. The drafter gets that as its cost curve: c(1 + k) = T(n) +
w (T(n + k) - T(n)), with w the tokens the batch emits per step (1 for a lone request, where c is
T itself). So a batch that fills drafts less, and no draft runs where the measured costs say it
would not pay.

Exploring: nothing is drafted until a step was timed. Beyond the largest step timed, n_max, costs
follow the slope of the last two timed sizes (flat with one), but only up to 2 n_max; a draft
that would take the step further is priced out. So drafting explores at most a doubling of the
step at a time (a lone request on a machine where extra tokens are nearly free reaches 8 tokens in
three steps), and one step of a new batch size costs at most twice a known one. A size's timing is
forgotten after ``StepCosts.max_age`` steps without a new one, so a cost timed in a slow spell is
timed again.

**Probes.** A drafter now and then drafts with optimistic rates (evidence it has not rated looks
perfect), spaced so that its losing probes cost at most a share of its time; priced at the
batch's weight, each row's probes spend about that share divided by the rows, and the batch's
rows together about the whole share, every step. But the rows' drafters rate the same kinds of
evidence (a new request starts from the rates of the last one), so the batch needs about as many
probes per step as one request: each row gets ``PROBE_BUDGET`` divided by the rows. Measured on an
AVX2-only CPU at 16 clients, where a drafted token costs a row (docs/journal.md): per-row budgets
of 10% cost 8-10% of the throughput; with the budget split, one 16-client MT-bench run served
1.01x no speculation (it was 0.90x).

Why online and not a calibration in ``load_model``: vLLM's forward pass needs its scheduler's
metadata (attention, slots), which a proposer cannot build; and the time between calls is the
cost the engine really pays under its own load (its scheduler, its sampler, other processes).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from .drafting import Draft, TreeDrafter
from .lookup import ContextIndex
from .pool import PoolFeed, SharedPool

logger = logging.getLogger(__name__)

KEY_TOKENS = 8  # tokens at each end of a text that (with its length) key its request's state
SHARED_CANDIDATES = 4  # warm-pool continuations per lookup (the drafter's G elsewhere)
POOL_FEED = 2048  # text positions added to the warm pool per call, at most (a long text goes in over several)
PROBE_BUDGET = 0.1  # a lone request's share of time for losing probes; a batch's rows split it


@dataclass(frozen=True)
class ProposerOptions:
    """What the proposer may be told (vLLM: ``additional_config={"lookahead": {...}}``).

    ``shared_pool``: the warm pool, texts of earlier requests shared by all (see docs/vllm.md for
    what that reveals); ``pool_entries`` / ``pool_bytes``: its bounds (``SharedPool``);
    ``max_requests``: request states kept, the batch's and those that left it most recently."""

    shared_pool: bool = True
    pool_entries: int = 500_000
    pool_bytes: int = 128 * 2**20
    max_requests: int = 1024

    @classmethod
    def from_mapping(cls, given: Mapping) -> ProposerOptions:
        """Options from a mapping; an unknown name or a wrong type is refused, naming it."""
        if not isinstance(given, Mapping):
            raise ValueError(f"lookahead's options must be a mapping of names to values, got {given!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ValueError(f"unknown lookahead option(s) {', '.join(map(repr, unknown))}: use {', '.join(fields)}")
        for name, value in given.items():
            kind = type(getattr(cls, name))
            if type(value) is not kind or (kind is int and value < 1):
                wanted = "true or false" if kind is bool else "a positive integer"
                raise ValueError(f"lookahead option {name!r} must be {wanted}, got {value!r}")
        return cls(**given)


class StepCosts:
    """The engine's seconds per step by the tokens it verifies (rows + drafted tokens: a row and a
    drafted token cost alike, each one position of the step), learnt from observed steps. A token
    count's estimate is the median of its last ``keep`` observations, forgotten once unobserved for
    ``max_age`` steps; across token counts the estimates are made non-decreasing (pooled where a
    larger count timed cheaper) and linear between them. Beyond the largest count timed, n_max, they
    follow the slope of the last two (flat with one), up to ``explore`` x n_max; further than that a
    step is unknown. So drafting explores step sizes a doubling at a time, and every size the batch
    reaches plain is timed by its plain steps.

    The estimates are tabulated by token count once per observation: every row of every call
    prices its draft from that table (:meth:`curve`), so the fit is not redone per row."""

    def __init__(self, keep: int = 9, max_age: int = 512, explore: float = 2.0) -> None:
        self.keep, self.max_age, self.explore = keep, max_age, explore
        self._cells: dict[int, tuple[deque, int]] = {}  # tokens -> (seconds, last step)
        self._points: list[tuple[int, float]] | None = None  # the fitted points, until the next observation
        self._table: list[float] = []  # seconds by tokens (index 0: unused), up to explore x n_max
        self.steps = 0

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        self.steps += 1
        self._points = None
        tokens = rows + drafted
        recent = self._cells[tokens][0] if tokens in self._cells else deque(maxlen=self.keep)
        recent.append(seconds)
        self._cells[tokens] = (recent, self.steps)

    def points(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of the fresh cells, seconds made non-decreasing by pooling neighbours
        (pool-adjacent-violators, each cell weighted by its observations)."""
        if self._points is None:
            self._fit()
        return self._points

    def _fit(self) -> None:
        for tokens in [t for t, (_, last) in self._cells.items() if self.steps - last >= self.max_age]:
            del self._cells[tokens]
        blocks: list[list] = []  # [observations, mean seconds, token counts of the block]
        for tokens in sorted(self._cells):
            recent = self._cells[tokens][0]
            blocks.append([len(recent), statistics.median(recent), [tokens]])
            while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
                (w1, s1, t1), (w2, s2, t2) = blocks.pop(-2), blocks.pop()
                blocks.append([w1 + w2, (w1 * s1 + w2 * s2) / (w1 + w2), t1 + t2])
        self._points = [(t, s) for _, s, members in blocks for t in members]
        self._table = _tabulate(self._points, int(self.explore * self._points[-1][0])) if self._points else []

    def seconds(self, rows: int, drafted: int) -> float | None:
        """Estimated seconds of a step over ``rows`` rows verifying ``drafted`` draft tokens in all;
        None where nothing was timed, or where it is more than ``explore`` x the largest step
        timed."""
        self.points()
        tokens = rows + drafted
        return self._table[tokens] if tokens < len(self._table) else None

    def curve(self, rows: int, drafted: int, weight: float, max_draft: int) -> StepPrices:
        """The cost curve a row's drafter prices its draft with (see the module docstring): point
        1 + k is T(rows + drafted) + ``weight`` x the extra seconds its k tokens add to the step.
        Where the step without this row's draft is unknown, a curve on which nothing pays (the step
        then runs, and is timed); a draft longer than the known steps allow is priced out."""
        self.points()
        start, table = rows + drafted, self._table
        if start >= len(table) or table[start] <= 0:
            return NO_DRAFT
        base = table[start]
        known = table[start : min(len(table), start + max_draft + 1)]
        return StepPrices(tuple(base + weight * max(0.0, seconds - base) for seconds in known))


class StepPrices:
    """A row's cost curve, c(1 + k) for k = 0 .. the longest draft priced; a longer one never pays.
    Called as :class:`lookahead.costs.CostCurve` is, with the step's tokens (1 + k)."""

    __slots__ = ("prices",)

    def __init__(self, prices: tuple[float, ...]) -> None:
        self.prices = prices

    def __call__(self, tokens: int) -> float:
        return self.prices[tokens - 1] if tokens <= len(self.prices) else 1e9


NO_DRAFT = StepPrices((1.0,))  # a curve on which no draft pays


@dataclass
class _Request:
    """One request's state: its text, the index of its suffixes, its drafter, and the draft
    proposed for it at the last call that saw it."""

    tokens: list[int]
    index: ContextIndex
    drafter: TreeDrafter
    draft: Draft | None = None
    drafted: int = 0  # tokens of that draft
    seen: int = -1  # the call that last saw it


class ChainProposer:
    """One draft chain per row of an engine's batch; see the module docstring. Never raises from
    :meth:`propose`: a row whose drafting fails gets [] (logged once, counted in ``errors``)."""

    def __init__(
        self,
        max_draft: int,
        max_model_len: int,
        options: ProposerOptions | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_draft < 1 or max_model_len < 2:
            raise ValueError(f"need max_draft >= 1 and max_model_len >= 2, got {max_draft} and {max_model_len}")
        self.max_draft, self.max_model_len = max_draft, max_model_len
        self.options = options or ProposerOptions()
        self.clock = clock
        o = self.options
        self.shared = SharedPool(o.pool_entries, o.pool_bytes) if o.shared_pool else None
        self.costs = StepCosts()
        self._requests: OrderedDict[tuple, list[_Request]] = OrderedDict()  # key -> states, least recent first
        self._stored = 0  # states in _requests
        self._rows: list[_Request] = []  # the requests the last call drafted for
        self._leaving = PoolFeed()  # texts of requests that left, on their way into the warm pool
        self._calls = 0
        self._ended: float | None = None  # when the last call returned
        self.emitted_per_row = 1.0  # tokens a row emits per step (a running mean)
        self.errors = 0

    def propose(self, sampled: Sequence[Sequence[int]], texts: Sequence[Sequence[int]]) -> list[list[int]]:
        """``sampled[i]``: the tokens row i emitted this step ([] where it emitted none: a prefill
        chunk); ``texts[i]``: its tokens so far, those included. Returns row i's draft."""
        started = self.clock()
        self._calls += 1
        requests = [
            self._guarded(self._follow, None, text, emitted) for text, emitted in zip(texts, sampled, strict=True)
        ]
        self._observe_step(requests, started)
        drafts, drafted = [], 0
        for request in requests:
            chain = self._guarded(self._draft, [], request, len(requests), drafted) if request else []
            drafted += len(chain)
            drafts.append(chain)
        self._guarded(self._settle, None, [r for r in requests if r is not None])
        self._ended = self.clock()
        return drafts

    def _guarded(self, work: Callable, fallback, *args):
        try:
            return work(*args)
        except Exception:  # never into the engine's step: this row drafts nothing
            self.errors += 1
            if self.errors == 1:
                logger.exception("lookahead's proposer failed; that row drafts nothing (later failures only counted)")
            else:
                logger.debug("lookahead's proposer failed again (%d failures)", self.errors, exc_info=True)
            return fallback

    # -- one row ---------------------------------------------------------------------------------

    def _follow(self, text: Sequence[int], emitted: Sequence[int]) -> _Request | None:
        """The state of the request in this row, brought up to its text (learning from what was
        emitted after its last draft); None for a row that emitted nothing."""
        if not emitted:
            return None
        n, m = len(text), len(emitted)
        key = _key(text, n - m)
        states = self._requests.get(key)
        if states:
            request = states.pop()
            self._stored -= 1
            if not states:
                del self._requests[key]
        else:
            request = self._new_request(text, n - m)
        if request.seen == self._calls - 1 and request.draft is not None:
            request.drafter.record(request.draft, [int(t) for t in emitted])
        else:
            request.drafter.forget_pending()
            request.draft, request.drafted = None, 0
        request.tokens.extend(int(t) for t in text[len(request.tokens) : n])
        request.index.extend(request.tokens)
        key = _key(request.tokens, n)
        self._requests.setdefault(key, []).append(request)
        self._requests.move_to_end(key)
        self._stored += 1
        self.emitted_per_row += 0.05 * (m - self.emitted_per_row)
        return request

    def _new_request(self, text: Sequence[int], length: int) -> _Request:
        drafter = TreeDrafter(NO_DRAFT, max_nodes=self.max_draft, max_leaves=1)
        if self._requests:  # start from the rates the most recent request learnt (text of one kind matches alike)
            drafter.carry_from(next(reversed(self._requests.values()))[-1].drafter)
        return _Request([int(t) for t in text[:length]], ContextIndex(), drafter)

    def _draft(self, request: _Request, rows: int, drafted: int) -> list[int]:
        """The best chain of the request's drafter, priced at this step's costs."""
        request.seen = self._calls
        request.draft, request.drafted = None, 0
        cap = min(self.max_draft, self.max_model_len - len(request.tokens) - 1)  # the engine verifies no further
        if cap <= 0:
            return []
        tokens = request.tokens
        sources = request.index.occurrences(tokens, cap, request.drafter.reach)
        if self.shared is not None:
            sources += [(0, c) for c in self.shared.candidates(tokens, cap, SHARED_CANDIDATES)]
        weight = 1 + (rows - 1) * self.emitted_per_row
        request.drafter.curve = self.costs.curve(rows, drafted, weight, cap)
        request.drafter.probe_overhead = PROBE_BUDGET / rows  # a probe is priced at the batch's weight
        draft = request.drafter.draft(sources, cap, max_leaves=1)
        chain = list(draft.candidates[0]) if draft.candidates else []
        request.draft, request.drafted = draft, len(chain)
        return chain

    # -- the batch -------------------------------------------------------------------------------

    def _observe_step(self, requests: Sequence[_Request | None], started: float) -> None:
        """The step since the last call, if every row of this call continues a row drafted for in
        the last one (else it prefilled, or followed a pause): its rows, drafted tokens, seconds."""
        if self._ended is None or not requests:
            return
        if all(r is not None and r.seen == self._calls - 1 for r in requests):
            self.costs.observe(len(requests), sum(r.drafted for r in requests), started - self._ended)

    def _settle(self, rows: list[_Request]) -> None:
        """Requests the last call drafted for and no row continued in this one left the batch:
        their texts go to the warm pool (a bounded number of positions per call); the least recent
        states beyond the bound go."""
        if self.shared is not None:
            for request in self._rows:
                if request.seen != self._calls:
                    self._leaving.add(self.shared, request.tokens)
        self._rows = rows
        while self._stored > self.options.max_requests:
            key, states = next(iter(self._requests.items()))
            states.pop(0)
            self._stored -= 1
            if not states:
                del self._requests[key]
        self._leaving.feed(POOL_FEED)


def _tabulate(points: list[tuple[int, float]], last: int) -> list[float]:
    """Seconds by tokens, 1 .. ``last`` (index 0 unused): flat below the first point and with one
    point, linear between points, the last two points' slope beyond them."""
    first_tokens, first_seconds = points[0]
    if len(points) == 1:
        return [0.0] + [first_seconds] * last
    table = [0.0] + [first_seconds] * min(last, first_tokens)
    segments = list(pairwise(points))
    for n, ((x0, y0), (x1, y1)) in enumerate(segments):
        end = last if n == len(segments) - 1 else min(x1, last)  # the last segment runs on
        table.extend(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) for tokens in range(x0 + 1, end + 1))
    return table


def _key(text: Sequence[int], length: int) -> tuple:
    """What finds a request's state: its text's length and first and last ``KEY_TOKENS`` tokens."""
    head = tuple(int(t) for t in text[: min(KEY_TOKENS, length)])
    tail = tuple(int(t) for t in text[max(0, length - KEY_TOKENS) : length])
    return (length, head, tail)
