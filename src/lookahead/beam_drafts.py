"""Drafts for beam search: what followed the running beams' last tokens earlier in the prompt or
in any beam's text.

Beams of one item share most of their text and differ in a few tokens, so a continuation seen in
one beam is often what another will pick. :class:`BeamDrafter` keeps, per batch item, a table from
each suffix of up to ``max_suffix`` tokens to the continuations that followed it, newest first,
fed with the prompt once and with the beams' text as it is committed; a beam's drafts are the
continuations of its longest matching suffix first.

    >>> drafter = BeamDrafter(batch=1, length=2)
    >>> drafter.feed(0, [5, 6, 7, 9, 6, 7, 8, 1])
    >>> drafter.drafts(0, [4, 6, 7], limit=3)  # "6 7" was followed by "8 1", and earlier by "9 6"
    [(8, 1), (9, 6)]
    >>> drafter.drafts(0, [3, 8], limit=3)  # "8" was followed by "1", so far
    [(1,)]
    >>> drafter.feed(0, [5, 6, 7, 9, 6, 7, 8, 1, 2], start=6)  # the text has grown by "2"
    >>> drafter.drafts(0, [3, 8], limit=3)
    [(1, 2)]
"""

from __future__ import annotations

from collections.abc import Sequence

PER_KEY = 8  # continuations kept per suffix


class BeamDrafter:
    def __init__(self, batch: int, length: int, max_suffix: int = 3) -> None:
        self.length, self.max_suffix = length, max_suffix
        # per item: suffix -> {continuation: None}, oldest first (a dict keeps insertion order)
        self._tables: list[dict[tuple[int, ...], dict[tuple[int, ...], None]]] = [{} for _ in range(batch)]

    def feed(self, item: int, tokens: Sequence[int], start: int = 0) -> None:
        """Index, in item's table, the continuation after each position from ``start`` on: its
        next ``length`` tokens, or as many as there are yet. Feeding a grown text again from
        before its old end replaces those short tails with the longer continuations: the text a
        beam has just committed is what it most often repeats, and its first tokens are what a
        step that drafts one token deep needs."""
        table, length = self._tables[item], self.length
        tokens = list(tokens)
        for end in range(max(0, start), len(tokens) - 1):
            continuation = tuple(tokens[end + 1 : end + 1 + length])
            for m in range(1, min(self.max_suffix, end + 1) + 1):
                found = table.setdefault(tuple(tokens[end - m + 1 : end + 1]), {})
                for cut in range(1, len(continuation) + 1):  # itself, or a tail it has grown from
                    found.pop(continuation[:cut], None)
                found[continuation] = None
                if len(found) > PER_KEY:
                    del found[next(iter(found))]

    def drafts(self, item: int, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of the text ``tokens``: those of its longest
        matching suffix first, newest first."""
        table, out = self._tables[item], {}
        for m in range(min(self.max_suffix, len(tokens)), 0, -1):
            for continuation in reversed(table.get(tuple(tokens[len(tokens) - m :]), {})):
                out.setdefault(continuation, None)
                if len(out) == limit:
                    return list(out)
        return list(out)
