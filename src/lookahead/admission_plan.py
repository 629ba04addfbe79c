"""Which queued requests one step of :class:`lookahead.service.Service` prefills.

Prompts are prefilled within a budget of ``prefill_chunk`` tokens a step (padding included), so
that a step that admits newcomers stays short for the requests already decoding: first the next
chunk of a long prompt under way; then newcomers whose prompts fit together in what is left, in
the queue's order; then, where the next one is longer than a chunk and none is under way, its first
chunk. A vision-language model's prompts are prefilled whole (:func:`plan_whole`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class StepPlan:
    """What one step prefills."""

    newcomers: list  # requests prefilled together, short prompts
    chunk: int  # tokens of the long prompt under way
    start: tuple | None  # (a request whose long prompt starts, its first chunk's tokens)


def plan_step(pending: deque, room: int, prefill_chunk: int, under_way: int | None) -> StepPlan:
    """Take this step's newcomers from ``pending`` (requests with ``prompt_ids``), at most ``room``
    of them, the long prompt under way included; ``under_way``: the tokens left of that prompt
    (None: there is none)."""
    budget, chunk = prefill_chunk, 0
    if under_way is not None:
        chunk, room = min(budget, under_way), room - 1
        budget -= chunk
    newcomers, longest, start = [], 0, None
    while pending and room > 0:
        length = len(pending[0].prompt_ids)
        if max(longest, length) * (len(newcomers) + 1) <= budget:
            newcomers.append(pending.popleft())
            longest, room = max(longest, length), room - 1
            continue
        left = budget - longest * len(newcomers)
        if length > prefill_chunk and under_way is None and left > 0:
            start = (pending.popleft(), left)
        break
    return StepPlan(newcomers, chunk, start)


def plan_whole(pending: deque, room: int, prefill_chunk: int) -> StepPlan:
    """A vision-language model's plan: newcomers in the queue's order while their prompts fit
    ``prefill_chunk`` tokens together, and the first whatever its length (its prefill is not cut
    in chunks)."""
    newcomers, total = [], 0
    while pending and room > 0:
        length = len(pending[0].prompt_ids)
        if newcomers and total + length > prefill_chunk:
            break
        newcomers.append(pending.popleft())
        total, room = total + length, room - 1
    return StepPlan(newcomers, 0, None)
