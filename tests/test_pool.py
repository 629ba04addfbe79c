"""The n-gram pool: a bounded LRU of continuations per first token."""

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookahead.pool import NGramPool, SharedPool


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
    bulk = NGramPool(ngram_size=n, capacity=capacity)  # the window's path: add_all
    bulk.add_all(tuple(gram[:n]) for gram in ngrams)
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
        assert pool.candidates(key) == bulk.candidates(key) == list(reversed(lru))
        assert len(pool.candidates(key)) <= capacity
    assert len(pool) == sum(len(v) for v in model.values())


def test_the_shared_pool_holds_about_the_memory_it_is_bounded_by():
    """The byte bound is an estimate: checked against what the pool really holds (tracemalloc),
    on random text, where suffixes rarely repeat and every entry pays for its own dict. An
    estimate of 160 bytes a pair held 2.5x its bound."""
    import gc
    import random
    import tracemalloc

    rng = random.Random(0)
    texts = [[rng.randrange(49152) for _ in range(1000)] for _ in range(40)]  # made before tracing
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        shared = SharedPool(max_bytes=4 * 2**20)
        for text in texts:
            shared.add_text(text)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert shared.nbytes <= shared.max_bytes and len(shared) < shared.max_entries  # the byte bound bit
    assert 0.7 * shared.max_bytes < held < 1.25 * shared.max_bytes, held / shared.max_bytes
