"""Greedy verification: longest agreeing prefix plus the bonus token."""

import pytest

from lookahead.verify import verify_choices

CASES = [
    # (first, candidates, predictions {(k, j): token}, emitted, candidate)
    (5, [], {}, (5,), None),  # nothing to verify: one token
    (5, [(4, 1)], {}, (5,), None),  # first token rejected
    (5, [(5, 9)], {(0, 0): 6}, (5, 6), 0),  # one accepted, then the bonus token 6
    (5, [(5, 6)], {(0, 0): 6, (0, 1): 7}, (5, 6, 7), 0),  # full match: bonus token after it
    (5, [(5, 9), (5, 6)], {(0, 0): 6, (1, 0): 6, (1, 1): 4}, (5, 6, 4), 1),  # the docstring example
    (5, [(4, 4), (5, 8), (5, 6, 3)], {(1, 0): 6, (2, 0): 6, (2, 1): 3, (2, 2): 0}, (5, 6, 3, 0), 2),
]


@pytest.mark.parametrize("first,candidates,table,emitted,candidate", CASES)
def test_verify_table(first, candidates, table, emitted, candidate):
    calls = []

    def predict(k, j):
        calls.append((k, j))
        return table[(k, j)]

    verdict = verify_choices(first, candidates, predict)
    assert verdict.emitted == emitted
    assert verdict.candidate == candidate
    assert verdict.accepted == len(emitted) - 1
    assert list(verdict.path) == calls  # only the accepted path is scored, in order
