"""The clairvoyant bound: how fast a drafting policy could be, were it to know which guesses match.

A policy decides, step by step, which candidates to verify; the model decides which of their
tokens it accepts. Given the text the model produced, a *clairvoyant* policy knows, at every
step, how far each candidate will match, so it verifies the best one cut to exactly its matched
length: a step of 1 + L input tokens that emits 1 + L tokens (the accepted L and the model's own
next token), or a plain step (L = 0). Paying the model's cost curve T, the cheapest way through
the whole text is a shortest path over positions,

    cost(i) = min over L <= best_i of  T(1 + L) / T(1) + cost(i + 1 + L),   cost(end) = 0,

where best_i is the longest match (capped at ``cap`` tokens) among the candidates at position i,
and the bound is the speedup over plain decoding: (tokens - 1) / cost(s) (the first token comes
from the prefill, in both; the prefill may also verify a candidate at position 0, as transformers'
prompt lookup does, so the decode starts at the best s from 1 to 1 + best_0). No policy using the same
candidates and paying the same costs can beat it, so a measured speedup divided by the bound says
how much of what the candidates allow a policy reaches.

The candidates at position i (the text before it: the prompt and the first i output tokens):
every earlier occurrence of the longest suffix of that text (up to ``max_suffix`` tokens) seen
earlier in it, and the up to ``cap`` tokens that followed each (SuffixDecoding's and prompt
lookup's source); plus, where given, the candidates the decoding loop had at hand when a step
started at i (its n-gram pool, the window's n-grams, the shared pool; for transformers' prompt
lookup, :func:`prompt_lookup_candidates`, which takes the earliest occurrence of a suffix of at
most 2 tokens and is often not among the former).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .costs import CostCurve


@dataclass(frozen=True)
class Bound:
    speedup: float  # tokens / the clairvoyant cost, in plain steps
    tokens: int  # output tokens
    steps: int  # forward passes the clairvoyant path takes
    cap: int  # the longest candidate it may verify


def suffix_candidates(text: Sequence[int], max_suffix: int = 4, length: int = 7) -> list[tuple[int, ...]]:
    """What followed every earlier occurrence of the longest suffix of ``text`` (up to
    ``max_suffix`` tokens) that occurred earlier: up to ``length`` tokens each, newest first."""
    text = list(text)
    last = len(text) - 1
    for m in range(min(max_suffix, last), 0, -1):
        suffix, final = text[last - m + 1 :], text[last]
        ends = [e for e in range(m - 1, last) if text[e] == final and text[e - m + 1 : e + 1] == suffix]
        if ends:
            return [tuple(text[e + 1 : e + 1 + length]) for e in reversed(ends)]
    return []


def prompt_lookup_candidates(
    prompt: Sequence[int], output: Sequence[int], max_ngram: int = 2, length: int = 10
) -> dict[int, list[tuple[int, ...]]]:
    """The candidate transformers' prompt lookup (``prompt_lookup_num_tokens=length``,
    ``max_matching_ngram_size=max_ngram``) verifies at each output position i of ``output``: for
    the longest suffix of the text before i (up to ``max_ngram`` tokens) found earlier in it, the
    up to ``length`` tokens after its earliest occurrence that has any."""
    text = [*prompt, *output]
    found = {}
    for i in range(len(output)):  # at 0, in the prefill
        end = len(prompt) + i  # the text before output position i
        for m in range(min(max_ngram, end - 1), 0, -1):
            suffix = text[end - m : end]
            start = next((s + m for s in range(end - m) if text[s : s + m] == suffix), None)
            if start is not None:
                found[i] = [tuple(text[start : min(start + length, end)])]
                break
    return found


def matched(candidate: Sequence[int], target: Sequence[int]) -> int:
    """Leading tokens of ``candidate`` equal to ``target``'s."""
    count = 0
    for a, b in zip(candidate, target, strict=False):
        if a != b:
            break
        count += 1
    return count


def clairvoyant_bound(
    prompt: Sequence[int],
    output: Sequence[int],
    curve: CostCurve,
    *,
    cap: int = 7,
    max_suffix: int = 4,
    extra: Mapping[int, Sequence[Sequence[int]]] | None = None,
) -> Bound:
    """The clairvoyant speedup on ``output`` (the tokens generated after ``prompt``), paying
    ``curve``; ``extra[i]``: more candidates at output position i (the loop's). See the module
    docstring."""
    return clairvoyant_bounds(prompt, output, curve, caps=(cap,), max_suffix=max_suffix, extra=extra)[cap]


def clairvoyant_bounds(
    prompt: Sequence[int],
    output: Sequence[int],
    curve: CostCurve,
    *,
    caps: Sequence[int] = (7,),
    max_suffix: int = 4,
    extra: Mapping[int, Sequence[Sequence[int]]] | None = None,
) -> dict[int, Bound]:
    """:func:`clairvoyant_bound` for each cap in ``caps``, matching the candidates once (a match
    within a shorter cap is the longer cap's, cut)."""
    if any(cap < 0 for cap in caps):
        raise ValueError(f"cap must be >= 0, got {min(caps)}")
    curve = CostCurve.from_points(curve)
    n, widest = len(output), max(caps)
    text = [*prompt, *output]
    longest = [0] * n  # the longest match at each position within the widest cap (at 0: in the prefill)
    for i in range(n):
        candidates = suffix_candidates(text[: len(prompt) + i], max_suffix, widest)
        candidates += list((extra or {}).get(i, ()))
        longest[i] = max((matched(c, output[i:]) for c in candidates), default=0)
    if n:
        longest[0] = min(longest[0], max(0, n - 2))  # the decode keeps a step (see _shortest_path)
    return {cap: _shortest_path([min(m, cap, n - 1 - i) for i, m in enumerate(longest)], curve, cap) for cap in caps}


def _shortest_path(best: list[int], curve: CostCurve, cap: int) -> Bound:
    """The cheapest way through the decode, stepping at most ``best[i]`` tokens past the model's
    own at position i. The prefill emits token 0 and may verify ``best[0]`` more (transformers'
    prompt lookup verifies its first candidate there), at no decode cost: the decode starts at
    the best of positions 1 to 1 + best[0]. ``best[0]`` is kept under n - 1, so that a prefill
    that could emit the whole text still leaves one step and the bound stays finite."""
    n = len(best)
    if n == 0:
        return Bound(1.0, 0, 0, cap)
    unit = curve(1)
    cost = [0.0] * (n + 1)
    steps = [0] * (n + 1)
    for i in range(n - 1, 0, -1):
        options = [(curve(1 + length) / unit + cost[i + 1 + length], length) for length in range(best[i] + 1)]
        cost[i], length = min(options)
        steps[i] = 1 + steps[i + 1 + length]
    start = min(range(1, 2 + best[0]), key=lambda i: (cost[i], i)) if n > 1 else 1
    decode = n - 1  # the prefill's token costs what plain decoding's does: tokens per unit of cost
    speedup = decode / cost[start] if decode else 1.0
    return Bound(speedup, n, steps[start] + 1, cap)
