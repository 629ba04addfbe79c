"""Verification of candidate n-grams, greedy and sampled.

Sampling is greedy verification against draws: each position's token is the argmax of its
processed logits plus Gumbel noise keyed by (the sequence's seed, the position)
(:func:`position_noise`), an exact draw from the processed distribution; a candidate token is
accepted when it equals the draw at its position.

Glossary:
* **accepted tokens**: candidate tokens that equal the model's own greedy choice at their position;
* **bonus token**: the model's choice right after the last accepted token (always emitted);
* a step therefore emits ``accepted + 1`` tokens, between 1 and N.

The walk follows the model through the candidates, like a token tree: at depth j, the candidates
still alive are those whose first j tokens were all accepted. They share the same context, so
the first alive candidate's row gives the model's next choice.

Worked example, with y0 the model's choice after t, and ``predict(k, j)`` the model's choice after
token j of candidate k::

    candidates = [(5, 9), (5, 6)]      y0 = 5
    predict    = {(0, 0): 6, (1, 0): 6, (1, 1): 4}
    depth 0: both start with 5 == y0, emit predict(0, 0) = 6
    depth 1: only candidate 1 has 6 there, emit predict(1, 1) = 4
    -> emitted (5, 6, 4), accepted candidate 1 with 2 tokens (5, 6) and bonus token 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    emitted: tuple[int, ...]  # y0, then one token per accepted candidate token (the last is the bonus)
    candidate: int | None  # index of the accepted candidate, None when nothing was accepted
    path: tuple[tuple[int, int], ...]  # (candidate, depth) of the row behind each emitted token after y0

    @property
    def accepted(self) -> int:
        return len(self.emitted) - 1


def verify_choices(
    first: int,
    candidates: Sequence[Sequence[int]],
    predict: Callable[[int, int], int],
) -> Verdict:
    """Accept the longest candidate prefix that matches the model's choices (greedy picks or seeded
    draws alike), plus the bonus token.

    ``first`` is the model's choice after t; ``predict(k, j)`` gives its choice after token j of
    candidate k (called lazily, only along the accepted path).
    """
    emitted = [int(first)]
    path: list[tuple[int, int]] = []
    alive = list(range(len(candidates)))
    chosen = None
    depth = 0
    while alive:
        alive = [k for k in alive if depth < len(candidates[k]) and candidates[k][depth] == emitted[-1]]
        if not alive:
            break
        chosen = alive[0]
        emitted.append(int(predict(chosen, depth)))
        path.append((chosen, depth))
        depth += 1
    return Verdict(emitted=tuple(emitted), candidate=chosen, path=tuple(path))


def position_noise(seed: int, index: int, vocab: int) -> torch.Tensor:  # [V] float64
    """Gumbel noise for the token at ``index`` of a sequence sampled with ``seed``.

    ``argmax(processed_logits + noise)`` is an exact draw from ``softmax(processed_logits)``
    (the Gumbel-max trick), and the noise depends on nothing but (seed, index). So verification
    is greedy verification against these draws: a candidate token is accepted when it equals the
    draw at its position, and every token is distributed exactly as the model's processed
    distribution. The text is then a function of the seed and the prompt alone: the same with
    any candidates, any batch and any step shapes (and the same as one-token steps).

    torch's CPU generator (mt19937) keeps 32 bits of its seed, so (seed, index) is hashed into
    those 32 bits with splitmix64 over all 64 bits of the seed: two seeds then share a position's
    noise by chance alone (2**-32 per position), where a linear key had made seeds equal modulo
    2**32 share every position's.
    """
    key = _splitmix64((seed & _MASK64) ^ _splitmix64(index))
    generator = torch.Generator().manual_seed((key ^ (key >> 32)) & 0xFFFFFFFF)
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64).clamp_min(1e-300)
    return -torch.log(-torch.log(uniform))


_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser of ``x + golden gamma``: every output bit depends on every input bit."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
