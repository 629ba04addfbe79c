"""Count-based drafting for one sequence: a token tree grown node by node while it pays.

Where :class:`lookahead.tuning.WidthChooser` picks one setting (g candidates of n - 1 tokens) from
the acceptance seen after contexts like this one, the drafter prices every *token*. Its sources
are what followed each earlier occurrence of the context's longest repeated suffix (each earlier
place counted once, at the longest suffix that reaches it) and the pooled n-grams starting with t.
They are merged into a trie, and each node gets an estimate of the chance that the model agrees
with it once it agrees with its parent:

* its *evidence*: how many earlier occurrences continue through it (``support``), whether they all
  do (``unanimous``: every occurrence through its parent continues with it), how far back the
  context matches at the occurrence that found it (``level``: 1, 2, 3, then bands of 4-7, 8-15 and
  16+ tokens; 0 for pool n-grams), and whether it is a first token;
* a learned rate per evidence bucket: every node of every step's trie, drafted or not, whose
  parent the text went on with is an observation (did the text go on with it too?), scored as the
  tokens come in and kept over the last ``memory`` observations. Scoring only the drafted nodes
  would learn only about evidence that already looked good, and little of it where width is dear
  and most steps are plain. A bucket's rate is drawn towards its coarser bucket's (level, first
  token), and that towards a prior for the level, first token and unanimity (``PRIORS``, measured
  on the texts of 40 prompts), each with the weight of ``prior_weight`` observations.

A node's path probability is the product of the rates along its path (siblings normalised so that
they sum to at most 1: only one of them can match). Greedy verification accepts a path of the tree,
so the tokens a step is expected to emit are 1 + the sum of its nodes' path probabilities. Nodes
are added best first (a prefix of that order is always a tree), and the step runs the prefix of
k nodes with the highest expected tokens per unit of cost, (1 + E_k) / (T(1 + k) / T(1)), or a
plain step when none beats 1. So a long draft runs where the evidence is strong (a span that
repeated several times, identically), a short one or none where it is weak, and the tree's shape
follows the evidence: two continuations that split after a shared prefix both get verified when
each is likely enough to pay for its slots.

With a Jacobi window (W > 0), its n-grams reach the trie through the pool, as level-0 sources
priced by the rate learnt for pooled n-grams (the prompt's and the output's among them), and its R
rows ride along on every drafted step: a tree of k nodes then costs T(1 + R + k). A plain step
leaves the window out, except that one in so many carries it alone, spaced so that these steps add
at most ``window_overhead`` (10%) of plain decoding's time: the window's n-grams pay off in later
steps, which no step's price can tell, and on text where nothing gets drafted it would otherwise
never run. So the window runs where the tree it rides with pays for both (on a flat cost curve
nearly always, on a steep one rarely) and, within that budget, where nothing else is drafted.

Example: the context ends in ``a b`` which occurred three times before, followed by ``c d e``,
``c d e`` and ``c f``. The trie is c (support 3, unanimous) -> d (2 of 3) -> e (2, unanimous) and
c -> f (1 of 3). With rates of 0.9 for c, 0.6 for d, 0.95 for e and 0.3 for f, the path
probabilities are c 0.9, d 0.54, e 0.51, f 0.27; on a curve where a step over 4 tokens costs 1.7
plain ones, c + d + e (1 + 1.95 tokens for 1.7) beats c alone (1.9 for, say, 1.2) and all four.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .costs import CostCurve
from .tuning import PLAIN

Path = tuple[int, ...]
WINDOW_ONLY = (0, 0)  # a step that carries the window and no tree

# The prior of a node's rate, by its evidence level (``span_band``: 0 for a pooled n-gram), whether
# it is a first token and whether it is unanimous (every occurrence through its parent continues
# with it): how often such nodes matched, averaged over the greedy texts of 20 HumanEval and of 20
# MT-bench prompts (SmolLM2, 256 tokens; every node scored, drafted or not, as the drafter scores
# them). It is what a fresh drafter believes before it has seen any text: a first token after a
# one-token context match matched 10% of the time (38% where unanimous), one after a 16-token match
# 93-100%. The formula it replaces, 0.3 + 0.5 x the share of occurrences through the node, put a
# unanimous first token after a one-token match at 0.8, and a fresh drafter lost most of its first
# bets. Learnt rates take over within a few dozen observations per bucket.
PRIORS = {  # (level, first token, unanimous) -> prior rate
    (0, False, False): 0.10, (0, True, False): 0.03,
    (1, False, False): 0.14, (1, False, True): 0.71, (1, True, False): 0.10, (1, True, True): 0.38,
    (2, False, False): 0.27, (2, False, True): 0.77, (2, True, False): 0.24, (2, True, True): 0.64,
    (3, False, False): 0.34, (3, False, True): 0.80, (3, True, False): 0.49, (3, True, True): 0.66,
    (4, False, False): 0.31, (4, False, True): 0.91, (4, True, False): 0.48, (4, True, True): 0.99,
    (8, False, False): 0.48, (8, False, True): 0.94, (8, True, False): 0.63, (8, True, True): 0.88,
    (16, False, False): 0.87, (16, False, True): 0.99, (16, True, False): 0.93, (16, True, True): 1.0,
}  # fmt: skip


@dataclass(frozen=True)
class Draft:
    """One step's draft: the candidates (root-to-leaf paths of the tree; empty for a plain step),
    each drafted node's evidence bucket, and the tree's children by parent; and the whole trie the
    tree was cut from, drafted or not (what :meth:`TreeDrafter.record` scores against the text as
    it comes)."""

    candidates: list[Path]
    buckets: dict[Path, tuple]
    children: dict[Path, list[Path]]
    expected: float  # tokens the step is expected to emit
    probe: bool = False  # drafted with optimistic rates (see TreeDrafter)
    trie: Trie | None = None
    window: bool = False  # the step carries the Jacobi window's rows (every drafted step, some plain ones)


class TreeDrafter:
    """Drafts a token tree per step for one sequence; see the module docstring.

    ``curve``: the forward cost by new tokens; ``max_nodes`` / ``max_leaves``: the most draft
    tokens and candidates per step (G x (N - 1) and G).
    """

    def __init__(
        self,
        curve: CostCurve,
        max_nodes: int,
        max_leaves: int,
        prior_weight: float = 3.0,
        memory: int = 2048,
        probe_every: int = 8,
        max_interval: int = 64,
        probe_overhead: float = 0.1,
        window_overhead: float = 0.1,
        reach: int = 32,
        learn_undrafted: bool = True,
    ) -> None:
        self.curve = curve
        # how far back a source's context match is measured (ContextIndex.occurrences): spans of
        # 1, 2, 3, 4-7, 8-15 and 16+ tokens are told apart (``span_band``)
        self.reach = reach
        # every trie node is scored against the text once the text reaches it, drafted or not: the
        # rates then learn from all the evidence, not only from what was drafted (which, where
        # width is dear, is little, and only what already looked good)
        self.learn_undrafted = learn_undrafted
        self._pending: deque = deque()  # [trie's children, trie's buckets, tokens seen since] per step
        self.max_nodes, self.max_leaves = max_nodes, max_leaves
        self.prior_weight = prior_weight
        self.memory = memory
        # probes: now and then the tree is drafted with optimistic rates (unobserved evidence looks
        # perfect), so that evidence the estimates undervalue gets observed; at most every
        # ``probe_every`` steps, spaced so that a losing probe adds at most ``probe_overhead`` of
        # plain decoding's time, and half as often after each probe that accepted nothing
        self.probe_every, self.max_interval, self.probe_overhead = probe_every, max_interval, probe_overhead
        self._since_probe = 0
        self._interval = probe_every
        # a window rides on every drafted step; of the others, one in so many carries it alone, so
        # that these add at most ``window_overhead`` of plain decoding's time: the window's n-grams
        # help later steps only, which no step's price can tell, and where nothing gets drafted it
        # would otherwise never run, nor ever propose anything
        self.window_overhead = window_overhead
        self._since_window = 0
        self._seen: deque = deque()  # (fine bucket, accepted) observations, oldest first
        self._fine: dict[tuple, list[int]] = {}  # bucket -> [accepted, observed]
        self._coarse: dict[tuple, list[int]] = {}  # (level, first token) -> [accepted, observed]
        self.chosen: Counter = Counter()  # (leaves, longest + 1) or PLAIN -> steps

    def carry_from(self, earlier: TreeDrafter) -> None:
        """Start from what ``earlier`` (a drafter of an earlier call, same model and settings) had
        learnt: its observations and its probe spacing. Text of one kind (code, chat) matches
        alike from one prompt to the next, while a few dozen steps of one call say little: a
        drafter starting from the priors alone overrates chat's repeated phrases."""
        for bucket, accepted in list(earlier._seen):  # a snapshot, should the other still run
            self._observe(bucket, accepted)
        self._interval = earlier._interval

    # -- estimates -------------------------------------------------------------------------------

    def rate(self, bucket: tuple, prior: float, optimistic: bool = False) -> float:
        """The chance that a node of ``bucket`` matches once its parent did: the bucket's observed
        rate, drawn towards its coarse bucket's, drawn towards ``prior``. ``optimistic`` (probes):
        drawn towards 1 instead, so that evidence never observed yet looks as good as it could be."""
        w = self.prior_weight
        acc, n = self._fine.get(bucket, (0, 0))
        if optimistic:
            return (acc + w) / (n + w)
        coarse_acc, coarse_n = self._coarse.get(bucket[:2], (0, 0))
        coarse = (coarse_acc + w * prior) / (coarse_n + w)
        return (acc + w * coarse) / (n + w)

    def _observe(self, bucket: tuple, accepted: bool) -> None:
        self._seen.append((bucket, accepted))
        self._tally(bucket, accepted, 1)
        if len(self._seen) > self.memory:
            self._tally(*self._seen.popleft(), -1)

    def _tally(self, bucket: tuple, accepted: bool, sign: int) -> None:
        fine = self._fine.get(bucket)
        if fine is None:
            fine = self._fine[bucket] = [0, 0]
        coarse = self._coarse.get(bucket[:2])
        if coarse is None:
            coarse = self._coarse[bucket[:2]] = [0, 0]
        if accepted:
            fine[0] += sign
            coarse[0] += sign
        fine[1] += sign
        coarse[1] += sign

    # -- one step --------------------------------------------------------------------------------

    def draft(
        self, sources: Sequence[tuple[int, Path]], cap: int, max_leaves: int | None = None, rider: int = 0
    ) -> Draft:
        """The tree to verify this step. ``sources``: (level, continuation) pairs, level >= 1 for
        an earlier occurrence where the context matches that many tokens back, 0 for a pooled
        n-gram (the Jacobi window's n-grams among them); ``cap``: the most tokens a candidate may
        have (the draft length, fewer near the sequence's end); ``rider``: input tokens that a
        drafted step carries besides t and the tree (the window's rows), priced as part of every
        tree's cost; a plain step carries them only within ``window_overhead`` (``Draft.window``)."""
        return self._count(self._ride(self._choose(sources, cap, max_leaves, rider), rider))

    def _choose(self, sources: Sequence[tuple[int, Path]], cap: int, max_leaves: int | None, rider: int) -> Draft:
        leaves_cap = self.max_leaves if max_leaves is None else min(max_leaves, self.max_leaves)
        trie = Trie(sources, cap)  # shared by the draft and a probe
        self._since_probe += 1
        if not trie.sources or leaves_cap <= 0:
            return Draft([], {}, {}, 1.0)
        draft = self._grow(trie, leaves_cap, optimistic=False, rider=rider)
        if draft.candidates or self._since_probe < self._interval:
            return draft
        if self._since_probe < math.ceil((self.curve(2 + rider) / self.curve(1) - 1) / self.probe_overhead):
            return draft  # even a one-token probe is too dear yet (the check below, without growing it)
        probe = self._grow(trie, leaves_cap, optimistic=True, rider=rider)
        if not probe.candidates:
            return probe
        extra = self.curve(1 + rider + len(probe.buckets)) / self.curve(1) - 1
        if self._since_probe < math.ceil(extra / self.probe_overhead):
            return draft  # too dear to probe yet
        self._since_probe = 0
        return dataclasses.replace(probe, probe=True)

    def _ride(self, draft: Draft, rider: int) -> Draft:
        """Whether the window's ``rider`` rows run this step (see ``window_overhead``)."""
        if not rider:
            return draft
        if draft.candidates:
            self._since_window = 0
            return dataclasses.replace(draft, window=True)
        self._since_window += 1
        extra = self.curve(1 + rider) / self.curve(1) - 1
        if self._since_window < math.ceil(extra / self.window_overhead):
            return draft
        self._since_window = 0
        return dataclasses.replace(draft, window=True)

    def _grow(self, trie: Trie, leaves_cap: int, optimistic: bool, rider: int = 0) -> Draft:
        """The best tree over the trie, with estimated (or, for probes, optimistic) rates; a tree of
        k nodes costs a step of 1 + ``rider`` + k input tokens."""
        # best first: a node enters after its parent (its path probability is at most the parent's),
        # and the step runs the prefix of that order with the most expected tokens per unit of cost
        order: list[tuple[Path, float]] = []
        chosen: set[Path] = set()
        leaves = 0
        rates: dict[tuple, float] = {}  # by bucket: fixed within a step
        heap = [(-r, i, c) for i, (r, c) in enumerate(self._child_rates(trie, (), optimistic, rates))]
        heapq.heapify(heap)
        tick = len(heap)
        best_k, best_rate, expected, total = 0, 1.0, 1.0, 1.0
        unit = self.curve(1)
        while heap and len(order) < self.max_nodes:
            neg, _, path = heapq.heappop(heap)
            opens_leaf = len(path) == 1 or any(c in chosen for c in trie.children(path[:-1]))
            if opens_leaf and leaves >= leaves_cap:
                continue  # a new branch, and no candidate left for it
            leaves += opens_leaf
            chosen.add(path)
            order.append((path, -neg))
            k, total = len(order), total - neg
            rate = total * unit / self.curve(1 + rider + k)
            if rate > best_rate:
                best_k, best_rate, expected = k, rate, total
            # no later node is likelier than this one: stop where even all the room left, filled at
            # this one's probability and priced at one node more, could not beat the best prefix
            room = self.max_nodes - k
            if not room or (total - room * neg) * unit / self.curve(2 + rider + k) <= best_rate:
                break
            for r, child in self._child_rates(trie, path, optimistic, rates):
                heapq.heappush(heap, (neg * r, tick, child))
                tick += 1
        kept = [path for path, _ in order[:best_k]]
        tree_children: dict[Path, list[Path]] = {}
        for path in kept:
            tree_children.setdefault(path[:-1], []).append(path)
        candidates = [p for p in kept if p not in tree_children]  # the leaves
        return Draft(candidates, {p: trie.buckets[p] for p in kept}, tree_children, expected, False, trie)

    def _child_rates(self, trie: Trie, parent: Path, optimistic: bool, rates: dict) -> list[tuple[float, Path]]:
        """The conditional rates of a node's children, siblings normalised to sum to at most 1 (only
        one of them can match). Rated only for the nodes the tree reaches, not the whole trie, and
        each bucket once (``rates``, kept by the caller for the step)."""
        kids, buckets = trie.children(parent), trie.buckets
        rated = []
        for child in kids:
            bucket = buckets[child]
            rate = rates.get(bucket)
            if rate is None:
                prior = PRIORS.get((bucket[0], bucket[1], bucket[3]), 0.1)  # pooled n-grams are never unanimous
                rate = rates[bucket] = self.rate(bucket, prior, optimistic)
            rated.append(rate)
        scale = 1.0 / max(1.0, sum(rated))
        return [(r * scale, child) for r, child in zip(rated, kids, strict=True)]

    def _count(self, draft: Draft) -> Draft:
        if draft.candidates:
            shape = (len(draft.candidates), 1 + max(map(len, draft.candidates)))
        else:
            shape = WINDOW_ONLY if draft.window else PLAIN
        self.chosen[shape] += 1
        return draft

    def record(self, draft: Draft, emitted: Sequence[int]) -> None:
        """Learn from one step: ``emitted`` are the tokens verification produced (the accepted
        ones, then the bonus token). Every drafted child of an accepted node (t, then each accepted
        token) was tested: it matched if it equals the token the step emitted there."""
        if draft.probe:  # back off while probes accept nothing
            lost = not any((token,) in draft.buckets for token in emitted[:1])
            self._interval = min(self.max_interval, 2 * self._interval) if lost else self.probe_every
        if not self.learn_undrafted:
            self._score(draft.children.get, draft.buckets, (), emitted)
            return
        # each earlier step's trie, and this one's, scored on the tokens that came after it
        if draft.trie is not None:
            self._pending.append([draft.trie.children, draft.trie.buckets, ()])
        live, tokens = deque(), tuple(emitted)
        for entry in self._pending:
            children, buckets, seen = entry
            entry[2] = seen + tokens
            if self._score(children, buckets, seen, tokens):
                live.append(entry)
        self._pending = live

    def forget_pending(self) -> None:
        """Drop the tries still being scored: the next step does not continue the text they were
        scored along (another sequence drafts, or steps of this one went undrafted in a batch)."""
        self._pending.clear()

    def _score(self, children: Callable, buckets: dict, seen: Path, tokens: Sequence[int]) -> bool:
        """Observe every child of the node reached by ``seen`` (the text since the trie's step)
        against each of ``tokens`` in turn; True while the trie still has a node to score.
        ``children``: a node's children by its path (None or [] for none)."""
        parent = seen
        for token in tokens:
            kids = children(parent)
            if not kids:
                return False
            hit = None
            for child in kids:
                matched = child[-1] == token
                self._observe(buckets[child], matched)
                if matched:
                    hit = child
            if hit is None:
                return False
            parent = hit
        return bool(children(parent))

    @property
    def wide_steps(self) -> int:
        return sum(count for choice, count in self.chosen.items() if choice != PLAIN)

    def summary(self) -> dict[str, int]:
        """Steps per draft shape, as "G=leaves,N=longest+1" (or "plain") -> steps."""
        names = {PLAIN: "plain", WINDOW_ONLY: "window"}
        return {names.get(c, f"G={c[0]},N={c[1]}"): n for c, n in sorted(self.chosen.items())}


def span_band(span: int) -> int:
    """The evidence level of a context match ``span`` tokens long: 0-3 as they are, then 4 (4-7),
    8 (8-15), 16 (16 and more)."""
    if span < 4:
        return span
    return 4 if span < 8 else 8 if span < 16 else 16


_BANDS = [span_band(span) for span in range(16)]  # span_band by span, tabled for the levels below 16


class Trie:
    """The sources, cut to ``cap`` tokens, merged into a trie whose nodes are made when first asked
    for: :meth:`children` groups the sources through a node by their next token. Drafting visits
    few nodes of a trie (the tree it grows, and the path the text then takes), so the rest are
    never made.

    A node's evidence (``buckets[path]``, made with the node): (level band, first token, support up
    to 3, unanimous), where support counts the earlier occurrences (sources of level > 0) through
    it, level is the longest context match among them (0: pool n-grams only), and unanimous says
    that every occurrence through its parent continues with it. Children come in the order the
    sources first reach them."""

    __slots__ = ("sources", "occurrences", "buckets", "_kids", "_through")

    def __init__(self, sources: Sequence[tuple[int, Path]], cap: int) -> None:
        self.sources = [(level, tuple(c[:cap])) for level, c in sources if cap > 0 and len(c)]
        self.occurrences = sum(level > 0 for level, _ in self.sources)
        self.buckets: dict[Path, tuple] = {}
        self._kids: dict[Path, list[Path]] = {}
        # every made node's sources (indices) and support, from which its children are made
        self._through: dict[Path, tuple[list[int], int]] = {(): (list(range(len(self.sources))), self.occurrences)}

    def children(self, parent: Path) -> list[Path]:
        """The children of a node (made, as every node :meth:`children` returned is)."""
        kids = self._kids.get(parent)
        if kids is None:
            kids = self._kids[parent] = self._make_children(parent)
        return kids

    def evidence(self, path: Path) -> tuple[int, int]:
        """(support, level) of a made node."""
        members, support = self._through[path]
        return support, max((self.sources[i][0] for i in members), default=0)

    def _make_children(self, parent: Path) -> list[Path]:
        members, above = self._through[parent]
        depth, sources = len(parent), self.sources
        groups: dict[int, list] = {}  # next token -> [sources, support, level]
        for i in members:
            level, continuation = sources[i]
            if len(continuation) > depth:
                group = groups.get(continuation[depth])
                if group is None:
                    group = groups[continuation[depth]] = [[], 0, 0]
                group[0].append(i)
                if level:
                    group[1] += 1
                    if level > group[2]:
                        group[2] = level
        first, kids = not parent, []
        for token, (through, support, level) in groups.items():
            path = (*parent, token)
            band = _BANDS[level] if level < len(_BANDS) else 16
            self.buckets[path] = (band, first, support if support < 3 else 3, 0 < support == above)
            self._through[path] = (through, support)
            kids.append(path)
        return kids
