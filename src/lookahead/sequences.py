"""The sequences of a batch: what each one has committed, its pool, window and settings, how a
step is planned for all of them, and how tokens are emitted sequence by sequence.

Words: a *sequence* is one member of the batch (one prompt and its output); a *slot* is one
position of a step's input (t, a window token, a candidate token; see ``lookahead.layout``).

Sequences share one layout per step (the batch is one forward pass), so a sequence with fewer
candidates than the widest one gets filler chains, and one that may emit fewer tokens gets its
candidates cut; filler slots are computed and ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .config import LookaheadConfig
from .layout import StepLayout, build_layout, node_tokens, tree_shape
from .lookup import ContextIndex
from .pool import NGramPool, SharedPool
from .step import Scorer
from .support import ModelTraits
from .verify import Verdict
from .window import JacobiWindow


@dataclass
class SeqState:
    """One sequence of the batch, with its own generation settings."""

    index: int  # position in the caller's batch (processors built for a batch see it there)
    prompt_ids: torch.Tensor  # [1, S]: the caller's prompt, padding kept
    committed: list[int]  # the prompt without padding, then every emitted token
    pool: NGramPool
    window: JacobiWindow
    max_length: int  # len(ids) at which the sequence ends
    processors: object = None  # LogitsProcessorList or None (greedy argmax of the raw logits)
    criteria: object = None  # StoppingCriteriaList called with (ids [1, S], scores)
    seed: int | None = None  # sampling: draws from noise keyed by (seed, position) (see verify.position_noise)
    batch_size: int = 1  # size of the batch the processors were built for
    max_candidates: int | None = None  # this sequence's own cap on G (None: the engine's)
    ngram_size: int | None = None  # this sequence's own cap on N
    context: ContextIndex | None = None  # longest-suffix lookup over the committed text
    shared: SharedPool | None = None  # n-grams of earlier sequences (a server's warm pool)
    carry: tuple[int, ...] = ()  # verified tokens after t that could not be committed yet
    candidates: list[tuple[int, ...]] = field(default_factory=list)  # this step's
    stopped_at: int | None = None  # len(ids) when a stopping criterion first fired
    steps: int = 0  # forward passes this sequence took part in (its prefill included)
    finished: bool = False  # left the batch
    cancelled: bool = False  # asked to leave at the next step boundary
    # when recording: the candidates at hand at each step, by the output position the step starts
    # at (what lookahead.bound's clairvoyant policy may pick from besides the text's own suffixes)
    trace: dict[int, list[tuple[int, ...]]] | None = None
    stop_check: _StopCheck | None = field(default=None, repr=False)  # built from ``criteria`` (Emitter)

    @property
    def t(self) -> int:
        return self.committed[-1]

    def __post_init__(self) -> None:
        self.start_length = self.prompt_ids.shape[1]
        self._prompt_tokens = len(self.committed)
        self._ids = self.prompt_ids

    @property
    def length(self) -> int:
        """len(ids): the caller's prompt (padding kept) and every emitted token."""
        return self.start_length + len(self.committed) - self._prompt_tokens

    @property
    def ids(self) -> torch.Tensor:  # [1, length]
        """The prompt and every emitted token as a tensor, for processors, criteria and the output;
        built when read (emitting a token only appends it to ``committed``)."""
        missing = self.length - self._ids.shape[1]
        if missing:
            new = torch.tensor([self.committed[-missing:]], dtype=self._ids.dtype)  # on the host, sent without a wait
            self._ids = torch.cat([self._ids, new.to(self._ids.device, non_blocking=True)], dim=-1)
        return self._ids

    @property
    def new_tokens(self) -> int:
        return self.length - self.start_length

    def match_length(self) -> int | None:
        """The longest suffix of the text seen earlier, in its own text or an earlier sequence's."""
        own = self.context.match_length(self.committed) if self.context is not None else None
        if self.shared is None:
            return own
        return max(own or 0, self.shared.match_length(self.committed))


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


def align(verdicts: Sequence[Verdict], seqs: Sequence[SeqState]) -> list[Verdict]:
    """Aligned runners: every sequence emits as many tokens as the shortest verdict; the verified
    tokens a sequence cannot emit now become its first candidate next step (``seq.carry``)."""
    width = min(len(v.emitted) for v in verdicts)
    out = []
    for verdict, seq in zip(verdicts, seqs, strict=True):
        seq.carry = verdict.emitted[width:]
        out.append(dataclasses.replace(verdict, emitted=verdict.emitted[:width], path=verdict.path[: width - 1]))
    return out


class Emitter:
    """Appends tokens to sequences as plain decoding would: stopping criteria, streamer, scores."""

    def __init__(self, streamer=None, want_scores: bool = False, want_logits: bool = False, stop_ends_seq: bool = True):
        self.streamer = streamer
        self.want_scores, self.want_logits = want_scores, want_logits
        # with an EOS criterion (or one sequence), a stopped sequence ends; without, transformers
        # keeps decoding it, unpadded, until every sequence has stopped
        self.stop_ends_seq = stop_ends_seq
        self.scores: tuple = ()
        self.logits: tuple = ()

    def emit(self, seq: SeqState, tokens: Sequence[int], slots: Sequence[int], scorer: Scorer) -> int:
        """Append tokens one by one until the sequence ends; returns how many were appended."""
        check = self._check(seq)
        for count, (token, slot) in enumerate(zip(tokens, slots, strict=True), start=1):
            if self.want_scores:
                self.scores += (scorer.processed(slot)[None],)
            if self.want_logits:
                self.logits += (scorer.raw(slot)[None],)
            seq.committed.append(token)
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
            if (
                seq.stopped_at is None
                and check is not None
                and check(seq, token, self.scores if self.want_scores else None)
            ):
                seq.stopped_at = seq.length
                if self.stop_ends_seq:
                    return count
        return len(tokens)

    @staticmethod
    def _check(seq: SeqState) -> _StopCheck | None:
        """The sequence's stop check, built once per criteria list and kept on the sequence (so it
        goes with it: a server's emitter outlives every request)."""
        criteria = seq.criteria
        if criteria is None or len(criteria) == 0:
            return None
        if seq.stop_check is None or seq.stop_check.criteria is not criteria:
            seq.stop_check = _StopCheck(criteria)
        return seq.stop_check


class _StopCheck:
    """Whether a sequence's stopping criteria fire after its latest token. transformers' EOS and
    max-length criteria are read off the token and the length (as they compute them, without a
    tensor per token); any other criterion is called with the sequence's ids. Criteria built for a
    batch see the sequence at its own index, in a batch of copies of it (sequences of a batch
    differ in length under lookahead)."""

    def __init__(self, criteria) -> None:
        self.criteria = criteria
        self.eos: set[int] = set()
        self.max_length: int | None = None
        others = []
        for criterion in criteria:
            if type(criterion) is EosTokenCriteria:
                self.eos.update(int(t) for t in criterion.eos_token_id.reshape(-1).tolist())
            elif type(criterion) is MaxLengthCriteria:
                limit = criterion.max_length
                self.max_length = limit if self.max_length is None else min(self.max_length, limit)
            else:
                others.append(criterion)
        self.others = StoppingCriteriaList(others)

    def __call__(self, seq: SeqState, token: int, scores) -> bool:
        if token in self.eos or self.max_length is not None and seq.length >= self.max_length:
            return True
        if not self.others:
            return False
        if seq.batch_size == 1:
            return bool(self.others(seq.ids, scores)[0])
        return bool(self.others(seq.ids.expand(seq.batch_size, -1), scores)[seq.index])


def assemble(seqs: Sequence[SeqState], prompt_len: int, stop_ends_seq: bool, pad_token_id) -> torch.Tensor:
    """The output [B, S + T] as transformers lays it out: T is the longest sequence up to its stop;
    shorter ones are padded after their stop; those that ran on past theirs are cut to T."""
    if stop_ends_seq:
        total = max(seq.length for seq in seqs)
    else:
        total = max(seq.stopped_at or seq.length for seq in seqs)
    first = seqs[0].ids
    if any(seq.length < total for seq in seqs) and pad_token_id is None:
        raise ValueError("sequences of the batch ended at different lengths: set generation_config.pad_token_id")
    out = first.new_full((len(seqs), total), 0 if pad_token_id is None else int(pad_token_id))
    for seq in sorted(seqs, key=lambda s: s.index):
        length = min(total, seq.length)
        out[seq.index, :length] = seq.ids[0, :length]
    return out
