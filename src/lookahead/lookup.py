"""Candidates from the text itself, looked up by the longest suffix of the context.

Small models repeat their prompt and themselves. For the context ``... a b c`` the index finds the
most recent earlier places where ``a b c`` occurred, then ``b c``, then ``c``, and proposes what
followed each, longest match first (more context matched, likelier continuation). Positions are
indexed as tokens are committed, so a lookup costs a few dictionary reads.

    >>> index = ContextIndex(max_suffix=2)
    >>> text = [5, 6, 7, 9, 6, 7, 8, 1, 6, 7]
    >>> index.extend(text)
    >>> index.candidates(text, length=2, limit=3)   # "6 7" occurred twice before: newest first
    [(8, 1), (9, 6)]
    >>> index.match_length(text)
    2
"""

from __future__ import annotations

from collections.abc import Sequence


class ContextIndex:
    def __init__(self, max_suffix: int = 3, per_key: int = 4) -> None:
        self.max_suffix = max_suffix
        self.per_key = per_key  # most recent occurrences kept per suffix
        # suffix -> where it ended, oldest first: tuples of ints, which the garbage collector stops
        # tracking, so a long text does not make its full passes come more often
        self._ends: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._indexed = 0  # tokens[:_indexed] are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index every suffix ending at the tokens appended since the last call."""
        for end in range(self._indexed, len(tokens)):
            for m in range(1, min(self.max_suffix, end + 1) + 1):
                suffix = tuple(tokens[end - m + 1 : end + 1])
                ends = self._ends.get(suffix, ()) + (end,)
                self._ends[suffix] = ends[1:] if len(ends) > self.per_key else ends
        self._indexed = len(tokens)

    def match_length(self, tokens: Sequence[int]) -> int:
        """Length of the longest suffix of ``tokens`` (up to ``max_suffix``) seen earlier: 0 when
        even the last token is new. A longer match makes the first candidate likelier right."""
        last = len(tokens) - 1
        for m in range(min(self.max_suffix, len(tokens)), 0, -1):
            if any(end < last for end in self._ends.get(tuple(tokens[len(tokens) - m :]), ())):
                return m
        return 0

    def occurrences(self, tokens: Sequence[int], length: int, reach: int = 0) -> list[tuple[int, tuple[int, ...]]]:
        """Every indexed earlier place where a suffix of the context ended, once each, at the
        longest suffix that reaches it: (suffix length, the ``length`` tokens that follow it, where they
        run into the present taken to repeat: see ``_continuation``),
        longest suffix first, newest first (what :class:`lookahead.drafting.TreeDrafter` counts).
        With ``reach`` above ``max_suffix``, a place found by the longest indexed suffix reports
        how far back the context really matches there, up to ``reach`` tokens: a copy of a long
        span is far likelier to go on than a chance 3-token match (SuffixDecoding's match length).

            >>> index = ContextIndex(max_suffix=2)
            >>> text = [5, 6, 7, 9, 6, 7, 8, 1, 5, 6, 7]
            >>> index.extend(text)
            >>> index.occurrences(text, length=2)
            [(2, (8, 1)), (2, (9, 6))]
            >>> index.occurrences(text, length=2, reach=8)   # "5 6 7" matched at the older place
            [(2, (8, 1)), (3, (9, 6))]
        """
        found: list[tuple[int, tuple[int, ...]]] = []
        seen: set[int] = set()
        last = len(tokens) - 1
        for m in range(min(self.max_suffix, len(tokens)), 0, -1):
            for end in reversed(self._ends.get(tuple(tokens[len(tokens) - m :]), ())):
                if end >= last or end in seen:
                    continue
                seen.add(end)
                continuation = _continuation(tokens, end, last, length)
                if continuation:
                    span = m
                    if m == self.max_suffix:  # the longest indexed suffix: see how far back it goes
                        while span < reach and span <= end and tokens[end - span] == tokens[last - span]:
                            span += 1
                    found.append((span, continuation))
        return found

    def candidates(self, tokens: Sequence[int], length: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of ``length`` tokens after earlier occurrences
        of the context's suffix, longest suffix first."""
        distinct = dict.fromkeys(continuation for _, continuation in self.occurrences(tokens, length))
        return list(distinct)[:limit]


def _continuation(tokens: Sequence[int], end: int, last: int, length: int) -> tuple[int, ...]:
    """The ``length`` tokens after position ``end`` (< ``last``, the text's last position). Where
    they would run past the text, it is taken to repeat with period ``last - end``: the context
    matches at ``end``, so what follows ``last`` is predicted to be what followed ``end``, and so
    on. A run (``a a a a``, a line repeated) then yields full-length candidates from its newest
    occurrences, the ones the index keeps, rather than the 1, 2 or 3 tokens that lie between them
    and the end of the text."""
    if end + length <= last:  # within the text: a plain slice (the usual case, and the cheap one)
        return tuple(tokens[end + 1 : end + 1 + length])
    period = last - end
    return tuple(tokens[end + 1 + j % period] for j in range(length))
