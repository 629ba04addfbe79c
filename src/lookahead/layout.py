"""The token layout of one lookahead step: which rows exist, where they sit, and what each sees.

One forward pass holds three parts, in this order (W=5, N=4, G=2, one prefix token ``t``)::

    row:        t | level 0     | level 1       | level 2       | cand 0 | cand 1
    column:     0 | 1  2  3  4  | 0  1  2  3  4 | 0  1  2  3  4 | -      | -
    position:   0 | 1  2  3  4  | 1  2  3  4  5 | 2  3  4  5  6 | 1 2 3  | 1 2 3
                  (positions relative to p, the position of t)

What each row sees inside the step (every row also sees the whole KV cache):

* the prefix (the committed tokens that are not cached yet; ``t`` is its last) is causal;
* level 0, column c sees the prefix and level-0 columns 1..c;
* level l, column c sees the prefix, level-0 columns 1..c and column c of levels 1..l
  (column 0 of level 0 *is* t, so a column reads as one contiguous run of positions);
* candidate k, token j sees the prefix and tokens 0..j of candidate k.

Nothing crosses between the lookahead and verification branches, or between candidates.

Mask of the example above (``x`` = may attend, rows and columns in input order)::

             t  l0 . . .  l1 . . . .  l2 . . . .  c0 . .  c1 . .
      t      x
      l0c1   x  x
      l0c2   x  x x
      l0c3   x  x x x
      l0c4   x  x x x x
      l1c0   x            x
      l1c1   x  x           x
      ...
      l2c1   x  x           x           x
      c0j0   x                                    x
      c0j1   x                                    x x
      c1j0   x                                            x
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class StepLayout:
    """Where every part of one step sits in the input. Built by :func:`build_layout`."""

    positions: torch.Tensor  # [L] int64, relative to the position of t
    mask: torch.Tensor  # [L, L] bool, True where a row may attend to a column
    t_row: int  # row of t, the last prefix token
    last_level_rows: tuple[int, ...]  # W rows whose outputs form the next window level
    level_rows: tuple[tuple[int, ...], ...]  # rows of each filled level (level 0 excludes t)
    candidate_rows: tuple[tuple[int, ...], ...]  # [g][candidate_len]
    length: int  # L
    logit_rows: torch.Tensor  # [K] sorted rows whose logits are used: t, last level, candidates
    logit_index: dict[int, int]  # row -> index into logit_rows
    candidate_position: dict[int, tuple[int, int]]  # candidate row -> (candidate k, token j)


@lru_cache(maxsize=256)
def build_layout(n_prefix: int, window: int, n_levels: int, n_candidates: int, candidate_len: int) -> StepLayout:
    """Lay out one step: ``n_prefix`` uncached tokens (the last is t), ``n_levels`` filled levels
    of a window of ``window`` columns, and ``n_candidates`` candidates of ``candidate_len`` tokens.

    Pure and cached: the same arguments return the same (read-only) tensors.
    """
    if n_prefix < 1:
        raise ValueError("a step needs at least one prefix token (t)")
    if window == 0:
        n_levels = 0
    if n_candidates == 0 or candidate_len == 0:
        n_candidates, candidate_len = 0, 0

    positions: list[int] = list(range(-(n_prefix - 1), 1))
    t_row = n_prefix - 1
    # sees[r] is the set of in-step rows that row r may attend to (itself included).
    sees: list[set[int]] = [set(range(r + 1)) for r in range(n_prefix)]
    prefix = set(range(n_prefix))

    level_rows: list[tuple[int, ...]] = []
    level0: list[int] = []  # level-0 rows; level0[c - 1] is column c (column 0 is t)
    column: list[list[int]] = [[] for _ in range(window)]  # rows of levels 1.. in each column
    for level in range(n_levels):
        rows = []
        for col in range(1 if level == 0 else 0, window):
            row = len(positions)
            positions.append(level + col)
            if level == 0:
                level0.append(row)
                sees.append(prefix | set(level0))
            else:
                column[col].append(row)
                sees.append(prefix | set(level0[:col]) | set(column[col]))
            rows.append(row)
        level_rows.append(tuple(rows))

    candidate_rows: list[tuple[int, ...]] = []
    for _ in range(n_candidates):
        rows = []
        for j in range(candidate_len):
            row = len(positions)
            positions.append(1 + j)
            sees.append(prefix | set(rows) | {row})
            rows.append(row)
        candidate_rows.append(tuple(rows))

    length = len(positions)
    mask = torch.zeros(length, length, dtype=torch.bool)
    for row, visible in enumerate(sees):
        mask[row, sorted(visible)] = True

    if n_levels == 0:
        last_level: tuple[int, ...] = ()
    elif n_levels == 1:
        last_level = (t_row, *level_rows[0])  # column 0 of level 0 is t itself
    else:
        last_level = level_rows[-1]
    used = sorted({t_row, *last_level, *(r for cand in candidate_rows for r in cand)})
    return StepLayout(
        positions=torch.tensor(positions, dtype=torch.long),
        mask=mask,
        t_row=t_row,
        last_level_rows=last_level,
        level_rows=tuple(level_rows),
        candidate_rows=tuple(candidate_rows),
        length=length,
        logit_rows=torch.tensor(used, dtype=torch.long),
        logit_index={row: i for i, row in enumerate(used)},
        candidate_position={r: (k, j) for k, cand in enumerate(candidate_rows) for j, r in enumerate(cand)},
    )
