"""The rows of a batch: what each one has committed, its pool and window, and how a step is
planned for all of them and emitted row by row.

Rows share one layout per step (the batch is one forward pass), so a row with fewer candidates
than the widest one gets filler chains, and a row that may emit fewer tokens gets its candidates
cut; filler rows are computed and ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .config import LookaheadConfig
from .layout import StepLayout, build_layout, node_tokens, tree_shape
from .lookup import ContextIndex
from .pool import NGramPool
from .step import Scorer
from .support import MaskSpec
from .verify import Verdict
from .window import JacobiWindow


@dataclass
class Row:
    """One sequence of the batch."""

    index: int  # row in the caller's batch
    ids: torch.Tensor  # [1, S + emitted]: the caller's row (padding kept) and every emitted token
    committed: list[int]  # the prompt without padding, then every emitted token
    pool: NGramPool
    window: JacobiWindow
    context: ContextIndex | None = None  # longest-suffix lookup over the committed text
    carry: tuple[int, ...] = ()  # verified tokens after t that could not be committed yet
    candidates: list[tuple[int, ...]] = field(default_factory=list)  # this step's
    stopped_at: int | None = None  # len(ids) when a stopping criterion first fired

    @property
    def t(self) -> int:
        return self.committed[-1]


def _cap(row: Row, n: int, spec: MaskSpec, limit: int) -> int:
    """The most candidate tokens row may verify with n-grams of n: n - 1, fewer near its limit
    or the end of the model's position table."""
    cap = min(n - 1, limit - row.ids.shape[1] - 1)
    if spec.max_positions is not None:
        cap = min(cap, spec.max_positions - len(row.committed))
    return cap


def _pooled(row: Row, length: int, g: int) -> list[tuple[int, ...]]:
    """Candidate sources in order of trust, untruncated: the verified tokens the row could not
    commit yet, the longest-suffix lookup over its text, then its pool (window n-grams first in
    recency)."""
    pooled = [row.carry] if row.carry else []
    if row.context is not None:
        pooled += row.context.candidates(row.committed, length, g)
    return pooled + row.pool.candidates(row.t, g)


def _pick(pooled: Sequence[tuple[int, ...]], g: int, length: int) -> list[tuple[int, ...]]:
    """The first g distinct candidates once cut to ``length`` tokens."""
    found: list[tuple[int, ...]] = []
    for candidate in pooled:
        candidate = tuple(candidate[:length])
        if candidate and candidate not in found:
            found.append(candidate)
            if len(found) == g:
                break
    return found


def _levels(rows: Sequence[Row], cfg: LookaheadConfig, spec: MaskSpec, wide: bool) -> int:
    n_levels = rows[0].window.n_levels if wide else 0
    if spec.max_positions is not None and any(
        len(row.committed) - 1 + n_levels + cfg.window_size - 1 > spec.max_positions for row in rows
    ):
        n_levels = 0  # the window would run past the position table: skip it this step
    return n_levels


def use_tree(rows: Sequence[Row], cfg: LookaheadConfig) -> bool:
    """Token trees need one layout per row: a batch of one (rows of a batch share the layout)."""
    return cfg.token_tree and len(rows) == 1


def step_sizes(
    row: Row, cfg: LookaheadConfig, spec: MaskSpec, limit: int, options: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], tuple[int, int]]:
    """For each option (g, n): the input tokens of the step it would run for this row, its
    candidates merged into a token tree, and how many candidates it would verify. What
    :class:`lookahead.tuning.WidthChooser` prices: shared prefixes and missing candidates cost
    nothing, and missing candidates accept nothing."""
    pooled = _pooled(row, max(0, _cap(row, cfg.ngram_size, spec, limit)), cfg.max_candidates)
    base = build_layout(1, cfg.window_size, _levels([row], cfg, spec, True)).length  # t and the window
    sizes = {}
    for g, n in options:
        cap = _cap(row, n, spec, limit)
        picked = _pick(pooled, g, cap) if cap > 0 and g > 0 else []
        nodes = {candidate[: j + 1] for candidate in picked for j in range(len(candidate))}  # = tree_shape's
        sizes[(g, n)] = (base + len(nodes), len(picked))
    return sizes


def plan_step(
    rows: Sequence[Row], cfg: LookaheadConfig, choice: tuple[int, int], spec: MaskSpec, limits: Sequence[int]
) -> tuple[StepLayout, list[list[int]]]:
    """Pick every row's candidates (``row.candidates``) and lay out one step for the batch.

    ``choice`` = (g, n): at most g candidates of n - 1 tokens; (0, 1) is a plain one-token step
    (no window either). ``limits[b]`` is the length row b may reach (so it emits at most
    ``limits[b] - len(ids)`` tokens). Candidates sharing a prefix share its rows (a token tree)
    in a batch of one; in a batch, every candidate gets rows of its own, and rows with fewer
    candidates get filler chains. Returns the layout and each row's input ids [B][L].
    """
    g, n = choice
    wide = n > 1
    for row, limit in zip(rows, limits, strict=True):
        cap = _cap(row, n, spec, limit)
        if wide and cap > 0 and g > 0:  # looked up as for the widest setting, as step_sizes does
            pooled = _pooled(row, _cap(row, cfg.ngram_size, spec, limit), cfg.max_candidates)
            row.candidates = _pick(pooled, g, cap)
        else:
            row.candidates = []
    n_levels = _levels(rows, cfg, spec, wide)
    window = rows[0].window.tokens() if n_levels else []
    if use_tree(rows, cfg):
        (row,) = rows
        shape = tree_shape(row.candidates)
        layout = build_layout(1, cfg.window_size, n_levels, shape=shape)
        return layout, [[row.t, *window, *node_tokens(row.candidates, shape)]]
    n_candidates = max(len(row.candidates) for row in rows)
    cand_len = max((len(c) for row in rows for c in row.candidates), default=0)
    layout = build_layout(1, cfg.window_size, n_levels, n_candidates, cand_len)
    step_ids = []
    for row in rows:
        ids = [row.t, *(row.window.tokens() if n_levels else [])]
        for k in range(n_candidates):
            candidate = list(row.candidates[k]) if k < len(row.candidates) else []
            ids += candidate + [row.t] * (cand_len - len(candidate))  # filler: computed, never read
        step_ids.append(ids)
    return layout, step_ids


def align(verdicts: Sequence[Verdict], rows: Sequence[Row]) -> list[Verdict]:
    """Aligned runners: every row emits as many tokens as the shortest verdict; the verified
    tokens a row cannot emit now become its first candidate next step (``row.carry``)."""
    width = min(len(v.emitted) for v in verdicts)
    out = []
    for verdict, row in zip(verdicts, rows, strict=True):
        row.carry = verdict.emitted[width:]
        out.append(dataclasses.replace(verdict, emitted=verdict.emitted[:width], path=verdict.path[: width - 1]))
    return out


class Emitter:
    """Appends tokens to rows as plain decoding would: stopping criteria, streamer, scores."""

    def __init__(
        self, stopping_criteria, streamer, want_scores: bool, want_logits: bool, stop_ends_row: bool, batch_size: int
    ):
        self.criteria = stopping_criteria
        self.batch_size = batch_size
        self.streamer = streamer
        self.want_scores, self.want_logits = want_scores, want_logits
        # with an EOS criterion (or one row), a stopped row ends; without, transformers keeps
        # decoding it, unpadded, until every row has stopped
        self.stop_ends_row = stop_ends_row
        self.scores: tuple = ()
        self.logits: tuple = ()

    def emit(self, row: Row, tokens: Sequence[int], layout_rows: Sequence[int], scorer: Scorer) -> int:
        """Append tokens one by one until the row ends; returns how many were appended."""
        for count, (token, layout_row) in enumerate(zip(tokens, layout_rows, strict=True), start=1):
            if self.want_scores:
                self.scores += (scorer.processed(layout_row)[None],)
            if self.want_logits:
                self.logits += (scorer.raw(layout_row)[None],)
            row.ids = torch.cat([row.ids, row.ids.new_tensor([[token]])], dim=-1)
            row.committed.append(token)
            if self.streamer is not None:
                self.streamer.put(row.ids.new_tensor([token]).cpu())
            if row.stopped_at is None and bool(self.criteria(row.ids, self.scores if self.want_scores else None).any()):
                row.stopped_at = row.ids.shape[1]
                if self.stop_ends_row:
                    return count
        return len(tokens)

    def _stops(self, row: Row) -> bool:
        """Whether the criteria stop this row; criteria built for a batch see it at its own index,
        in a batch of copies of it (rows of a batch differ in length under lookahead)."""
        scores = self.scores if self.want_scores else None
        if self.batch_size == 1:
            return bool(self.criteria(row.ids, scores).any())
        return bool(self.criteria(row.ids.expand(self.batch_size, -1), scores)[row.index])


def assemble(rows: Sequence[Row], prompt_len: int, stop_ends_row: bool, pad_token_id) -> torch.Tensor:
    """The output [B, S + T] as transformers lays it out: T is the longest row up to its stop;
    shorter rows are padded after their stop; rows that ran on past theirs are cut to T."""
    if stop_ends_row:
        total = max(row.ids.shape[1] for row in rows)
    else:
        total = max(row.stopped_at or row.ids.shape[1] for row in rows)
    first = rows[0].ids
    if any(row.ids.shape[1] < total for row in rows) and pad_token_id is None:
        raise ValueError("rows of the batch ended at different lengths: set generation_config.pad_token_id")
    out = first.new_full((len(rows), total), 0 if pad_token_id is None else int(pad_token_id))
    for row in sorted(rows, key=lambda r: r.index):
        length = min(total, row.ids.shape[1])
        out[row.index, :length] = row.ids[0, :length]
    return out
