"""The lookahead branch's state: a window of W Jacobi columns and up to N-1 levels.

Level 0 holds columns 1..W-1 (column 0 is t, the last accepted token); levels 1..N-2 hold W
columns each. After a step, the outputs of the last level form a new level:

* warm-up (fewer than N-1 levels): the new level is appended;
* full window: every column, read top to bottom plus its new token, is a fresh n-gram; then the
  window shifts up one level (level 0 drops its column 0, which t takes over).

Column c of a full window, with ``new`` the outputs of the last level::

    n-gram(c) = (level0[c] or t when c == 0, level1[c], ..., level{N-2}[c], new[c])
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class JacobiWindow:
    def __init__(
        self, window_size: int, ngram_size: int, seed_tokens: Sequence[int], seed: int = 0, full: bool = False
    ):
        """``full``: start with all N-1 levels filled (no warm-up), so that a window that joins a
        running batch has as many levels as the others."""
        self.window_size = window_size
        self.ngram_size = ngram_size
        self.levels: list[list[int]] = []
        if window_size > 0:
            # Start from tokens drawn from the prompt: plausible tokens, deterministic per prompt.
            rng = random.Random(seed)
            pool = list(seed_tokens) or [0]
            self.levels.append([rng.choice(pool) for _ in range(window_size - 1)])
            while full and not self.full:
                self.levels.append([rng.choice(pool) for _ in range(window_size)])

    @property
    def n_levels(self) -> int:
        return len(self.levels)

    @property
    def full(self) -> bool:
        return self.n_levels == self.ngram_size - 1

    def tokens(self, width: int | None = None, n_levels: int | None = None, filler: int = 0) -> list[int]:
        """The window's input tokens, level by level, in layout order; for a layout of ``width``
        columns and ``n_levels`` levels (a batch whose windows differ), missing columns and
        levels are ``filler`` tokens, computed and never read."""
        width = self.window_size if width is None else width
        n_levels = self.n_levels if n_levels is None else n_levels
        out = []
        for level in range(n_levels):
            have = self.levels[level] if level < self.n_levels else []
            out += have + [filler] * ((width - 1 if level == 0 else width) - len(have))
        return out

    def update(self, t: int, new_level: Sequence[int]) -> list[tuple[int, ...]]:
        """Take the last level's outputs (W tokens, column 0 first) and return the finished n-grams.

        ``t`` is the token that stood in column 0 of level 0 during the step.
        """
        new_level = [int(x) for x in new_level]
        if len(new_level) != self.window_size:
            raise ValueError(f"expected {self.window_size} new tokens, got {len(new_level)}")
        if not self.full:
            self.levels.append(new_level)
            ngrams: list[tuple[int, ...]] = []
        else:
            ngrams = list(
                zip([t, *self.levels[0]], *self.levels[1:], new_level, strict=True)
            )  # column c, top to bottom
            self.levels = self.levels[1:] + [new_level]
            self.levels[0] = self.levels[0][1:]  # t takes over column 0
        return ngrams
