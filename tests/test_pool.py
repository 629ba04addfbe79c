"""The n-gram pool: a bounded trie per first token with LRU eviction."""

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookahead.pool import NGramPool


def test_docstring_example():
    pool = NGramPool(ngram_size=3, capacity=2)
    pool.add((7, 1, 2))
    pool.add((7, 1, 3))
    pool.add((7, 1, 2))  # refresh
    assert pool.candidates(7) == [(1, 2), (1, 3)]
    pool.add((7, 4, 5))  # evicts (1, 3)
    assert pool.candidates(7) == [(4, 5), (1, 2)]
    assert (7, 1, 3) not in pool and (7, 4, 5) in pool
    assert pool.candidates(8) == []


def test_shared_prefixes_are_stored_once_and_pruned_on_eviction():
    pool = NGramPool(ngram_size=4, capacity=3)
    pool.add((1, 2, 3, 4))
    pool.add((1, 2, 3, 5))
    assert pool.trie_size(1) == 4  # 2 -> 3 -> {4, 5}
    pool.add((1, 9, 9, 9))
    pool.add((1, 8, 8, 8))  # evicts (2, 3, 4): node 4 goes, 2 -> 3 stays for 5
    assert pool.trie_size(1) == 3 + 3 + 3
    pool.add((1, 7, 7, 7))  # evicts (2, 3, 5): the whole 2 -> 3 branch goes
    assert pool.trie_size(1) == 9


def test_sequences_and_limits():
    pool = NGramPool(ngram_size=3, capacity=4)
    pool.add_sequence([5, 6, 7, 5, 6, 8])
    assert pool.candidates(5) == [(6, 8), (6, 7)]
    assert pool.candidates(5, limit=1) == [(6, 8)]
    pool.add_sequence([1, 2, 3, 4], start=1)  # only the n-grams from index 1 on
    assert pool.candidates(1) == [] and pool.candidates(2) == [(3, 4)]
    with pytest.raises(ValueError, match="3 tokens"):
        pool.add((1, 2))
    with pytest.raises(ValueError):
        NGramPool(ngram_size=1, capacity=2)
    with pytest.raises(ValueError):
        NGramPool(ngram_size=3, capacity=0)


@given(
    n=st.integers(2, 4),
    capacity=st.integers(1, 4),
    ngrams=st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=4), max_size=60),
)
def test_pool_behaves_like_a_bounded_lru_per_key(n, capacity, ngrams):
    pool = NGramPool(ngram_size=n, capacity=capacity)
    model: dict[int, OrderedDict] = {}
    for gram in ngrams:
        gram = tuple(gram[:n])
        pool.add(gram)
        lru = model.setdefault(gram[0], OrderedDict())
        lru.pop(gram[1:], None)
        lru[gram[1:]] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    for key, lru in model.items():
        assert pool.candidates(key) == list(reversed(lru))
        assert len(pool.candidates(key)) <= capacity
        # the trie holds exactly the distinct prefixes of what is stored, nothing stale
        prefixes = {path[:i] for path in lru for i in range(1, n)}
        assert pool.trie_size(key) == len(prefixes)
    assert len(pool) == sum(len(v) for v in model.values())
