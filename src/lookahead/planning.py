"""Planning a step: which candidates each sequence verifies, and the one layout the batch shares.

Words: a *sequence* is one member of the batch (one prompt and its output; see
``lookahead.sequences``); a *slot* is one position of a step's input (t, a window token, a
candidate token; see ``lookahead.layout``).

Candidates are looked up once per sequence, as for the widest setting (:func:`candidates_for`),
then cut per option: to price it (:func:`step_sizes`, :func:`at_hand`), to lay it out
(:func:`plan_step`, :func:`plan_tree`) or to draft from (:func:`draft_sources`). Sequences share
one layout per step (the batch is one forward pass), so a sequence with fewer candidates than the
widest one gets filler chains, and one that may emit fewer tokens gets its candidates cut; filler
slots are computed and ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import LookaheadConfig
from .layout import StepLayout, build_layout, node_tokens, tree_shape
from .sequences import SeqState
from .support import ModelTraits


def _cap(seq: SeqState, n: int, spec: ModelTraits, limit: int) -> int:
    """The most candidate tokens seq may verify with n-grams of n: n - 1, fewer near its limit
    or the end of the model's position table."""
    if seq.ngram_size is not None:
        n = min(n, seq.ngram_size)
    cap = min(n - 1, limit - seq.length - 1)
    t_position = len(seq.committed) - 1
    highest = spec.position_limit(t_position)
    if highest is not None:
        cap = min(cap, highest - t_position)
    return cap


def _gather(seq: SeqState, length: int, g: int) -> list[tuple[int, ...]]:
    """Candidate sources in order of trust, untruncated: the verified tokens the sequence could not
    commit yet, the longest-suffix lookup over its text, its pool (window n-grams first in
    recency), then the shared pool of earlier sequences."""
    found = [seq.carry] if seq.carry else []
    if seq.context is not None:
        found += seq.context.candidates(seq.committed, length, g)
    found += seq.pool.candidates(seq.t, g)
    if seq.shared is not None:
        found += seq.shared.candidates(seq.committed, length, g)
    return found


def _pick(pooled: Sequence[tuple[int, ...]], g: int, length: int) -> list[tuple[int, ...]]:
    """The first g distinct candidates once cut to ``length`` tokens."""
    found: dict[tuple[int, ...], None] = {}  # insertion-ordered, and a set for the test
    for candidate in pooled:
        candidate = tuple(candidate[:length])
        if candidate and candidate not in found:
            found[candidate] = None
            if len(found) == g:
                break
    return list(found)


def _own_g(seq: SeqState, g: int) -> int:
    return g if seq.max_candidates is None else min(g, seq.max_candidates)


def window_levels(seqs: Sequence[SeqState], cfg: LookaheadConfig, spec: ModelTraits, wide: bool = True) -> int:
    """The window levels a step carries: the batch's fullest window when the step is wide, none
    when it is plain or the window would run past a position the step may reach
    (``ModelTraits.position_limit``: the position table's end, a RoPE threshold)."""
    n_levels = max(seq.window.n_levels for seq in seqs) if wide else 0
    for seq in seqs:
        t_position = len(seq.committed) - 1
        highest = spec.position_limit(t_position)
        # the window's last level reaches n_levels - 1 + W - 1 positions past t
        if n_levels and highest is not None and t_position + n_levels + cfg.window_size - 2 > highest:
            return 0  # skip the window this step
    return n_levels


def use_tree(seqs: Sequence[SeqState], cfg: LookaheadConfig) -> bool:
    """Token trees need one layout per sequence: a batch of one (sequences of a batch share it)."""
    return cfg.token_tree and len(seqs) == 1


def candidates_for(seq: SeqState, cfg: LookaheadConfig, spec: ModelTraits, limit: int) -> list[tuple[int, ...]]:
    """seq's candidates this step, looked up once as for the widest setting and cut per option
    (by :func:`step_sizes`, :func:`at_hand` and :func:`plan_step`)."""
    return _gather(seq, max(0, _cap(seq, cfg.ngram_size, spec, limit)), cfg.max_candidates)


def step_sizes(
    seq: SeqState,
    cfg: LookaheadConfig,
    spec: ModelTraits,
    limit: int,
    options: Sequence[tuple[int, int]],
    found: Sequence[tuple[int, ...]],
) -> dict[tuple[int, int], tuple[int, int]]:
    """For each option (g, n): the input tokens of the step it would run for this sequence, its
    candidates (``found``, from :func:`candidates_for`) merged into a token tree, and how many candidates
    it would verify. What :class:`lookahead.tuning.WidthChooser` prices: shared prefixes and
    missing candidates cost nothing, and missing candidates accept nothing."""
    base = build_layout(1, cfg.window_size, window_levels([seq], cfg, spec, True)).length  # t and the window
    sizes = {}
    for g, n in options:
        cap = _cap(seq, n, spec, limit)
        g = _own_g(seq, g)
        picked = _pick(found, g, cap) if cap > 0 and g > 0 else []
        nodes = {candidate[: j + 1] for candidate in picked for j in range(len(candidate))}  # = tree_shape's
        sizes[(g, n)] = (base + len(nodes), len(picked))
    return sizes


def at_hand(
    seq: SeqState, cfg: LookaheadConfig, spec: ModelTraits, limit: int, found: Sequence[tuple[int, ...]]
) -> int:
    """How many of ``found`` (from :func:`candidates_for`) seq could verify this step at the widest setting
    (its own caps applied)."""
    cap, g = _cap(seq, cfg.ngram_size, spec, limit), _own_g(seq, cfg.max_candidates)
    if cap <= 0 or g <= 0:
        return 0
    return len(_pick(found, g, cap))


def plan_step(
    seqs: Sequence[SeqState],
    cfg: LookaheadConfig,
    choice: tuple[int, int],
    spec: ModelTraits,
    limits: Sequence[int],
    found: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> tuple[StepLayout, list[list[int]]]:
    """Pick every sequence's candidates (``seq.candidates``) and lay out one step for the batch.

    ``choice`` = (g, n): at most g candidates of n - 1 tokens; (0, 1) is a plain one-token step
    (no window either). ``limits[b]`` is the length sequence b may reach (so it emits at most
    ``limits[b] - len(ids)`` tokens). Candidates sharing a prefix share their slots (a token
    tree) in a batch of one; in a batch, every candidate gets slots of its own, and sequences
    with fewer candidates get filler chains. ``found[b]``: sequence b's :func:`candidates_for` candidates,
    when the caller looked them up already. Returns the layout and each sequence's input ids [B][L].
    """
    g, n = choice
    wide = n > 1
    for b, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
        cap, own_g = _cap(seq, n, spec, limit), _own_g(seq, g)
        if wide and cap > 0 and own_g > 0:  # looked up as for the widest setting, as step_sizes does
            seq.candidates = _pick(found[b] if found is not None else candidates_for(seq, cfg, spec, limit), own_g, cap)
        else:
            seq.candidates = []
    n_levels = window_levels(seqs, cfg, spec, wide)
    if use_tree(seqs, cfg):
        return plan_tree(seqs[0], cfg, n_levels)
    n_candidates = max(len(seq.candidates) for seq in seqs)
    cand_len = max((len(c) for seq in seqs for c in seq.candidates), default=0)
    layout = build_layout(1, cfg.window_size, n_levels, n_candidates, cand_len)
    step_ids = []
    for seq in seqs:
        t = seq.t
        ids = [t, *seq.window.tokens(cfg.window_size, n_levels, t)]
        for candidate in seq.candidates:
            ids += candidate
            if len(candidate) < cand_len:
                ids += [t] * (cand_len - len(candidate))  # filler: computed, never read
        ids += [t] * (cand_len * (n_candidates - len(seq.candidates)))  # filler chains
        step_ids.append(ids)
    return layout, step_ids


def plan_tree(
    seq: SeqState, cfg: LookaheadConfig, n_levels: int = 0, width: int | None = None
) -> tuple[StepLayout, list[list[int]]]:
    """One sequence's step: t, the window's ``n_levels`` levels (``width`` columns: W unless given)
    and ``seq.candidates`` merged into a token tree (shared prefixes share their slots). Returns the
    layout and the input ids [1][L]."""
    width = cfg.window_size if width is None else width
    shape = tree_shape(seq.candidates)
    layout = build_layout(1, width, n_levels, shape=shape)
    window = seq.window.tokens(width, n_levels, seq.t)
    return layout, [[seq.t, *window, *node_tokens(seq.candidates, shape)]]


def draft_sources(
    seq: SeqState, cfg: LookaheadConfig, spec: ModelTraits, limit: int, reach: int = 0
) -> tuple[int, list]:
    """What :class:`lookahead.drafting.TreeDrafter` drafts from: the longest a candidate may be
    (``cfg.max_emitted - 1``: the draft length, fewer near the sequence's limit or under its own
    cap on N), and (level, continuation) pairs: every earlier
    occurrence of the context's repeated suffix (level = how far back the context matches there,
    up to ``reach`` tokens; see ``ContextIndex.occurrences``), then the pooled n-grams starting
    with t and the shared pool's continuations (level 0)."""
    cap = max(0, _cap(seq, cfg.max_emitted, spec, limit))
    if cap == 0:
        return 0, []
    sources = seq.context.occurrences(seq.committed, cap, reach) if seq.context is not None else []
    sources += [(0, c) for c in seq.pool.candidates(seq.t, cfg.max_candidates)]
    if seq.shared is not None:
        sources += [(0, c) for c in seq.shared.candidates(seq.committed, cap, cfg.max_candidates)]
    return cap, sources
