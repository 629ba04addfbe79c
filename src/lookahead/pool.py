"""The n-gram pool: candidate continuations keyed by their first token.

Each key (a token id) keeps the n-1 tokens that followed it, at most ``capacity`` of them: a
repeated n-gram is not stored twice, and the least recently inserted or refreshed one is evicted
first (LRU). Continuations that share a prefix are merged when they are verified (the step's token
tree, ``lookahead.layout``), not here. The pool holds no model.

Example (n=3, capacity=2)::

    >>> pool = NGramPool(ngram_size=3, capacity=2)
    >>> pool.add((7, 1, 2)); pool.add((7, 1, 3)); pool.add((7, 1, 2))  # refreshes (1, 2)
    >>> pool.candidates(7)            # most recent first
    [(1, 2), (1, 3)]
    >>> pool.add((7, 4, 5))           # evicts (1, 3), the least recently used
    >>> pool.candidates(7)
    [(4, 5), (1, 2)]

Memory: one tuple of ints per stored n-gram and one ordered dict per key. Tuples of ints are
not tracked by Python's garbage collector once they have survived a collection, so a growing pool
does not make the collector's full passes (over every object of torch and transformers) come
more often.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class NGramPool:
    """A bounded pool of n-grams, looked up by their first token.

    ``ngram_size`` is N: every stored n-gram has N tokens, and a lookup returns the N-1 tokens that
    follow the key. ``capacity`` bounds the n-grams kept per key (G in the paper).
    """

    def __init__(self, ngram_size: int, capacity: int) -> None:
        if ngram_size < 2:
            raise ValueError(f"ngram_size must be at least 2, got {ngram_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.ngram_size = ngram_size
        self.capacity = capacity
        self._keys: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # key -> continuations, oldest first

    def add(self, ngram: Sequence[int]) -> None:
        """Insert (or refresh) one n-gram of exactly ``ngram_size`` tokens."""
        if len(ngram) != self.ngram_size:
            raise ValueError(f"expected an n-gram of {self.ngram_size} tokens, got {len(ngram)}")
        self._insert(int(ngram[0]), tuple(int(x) for x in ngram[1:]))

    def _insert(self, key: int, continuation: tuple[int, ...]) -> None:
        stored = self._keys.get(key)
        if stored is None:
            stored = self._keys[key] = OrderedDict()
        elif continuation in stored:
            stored.move_to_end(continuation)
            return
        stored[continuation] = None
        if len(stored) > self.capacity:
            stored.popitem(last=False)

    def add_all(self, ngrams: Iterable[tuple[int, ...]]) -> None:
        """Insert n-grams that are already tuples of ``ngram_size`` ints (the window's), in order."""
        for ngram in ngrams:
            self._insert(ngram[0], ngram[1:])

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Insert every n-gram of ``tokens`` (ints) that ends at index ``start + n - 1`` or later, in
        order."""
        n = self.ngram_size
        for i in range(max(0, start), len(tokens) - n + 1):
            self._insert(tokens[i], tuple(tokens[i + 1 : i + n]))

    def candidates(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The continuations stored for ``key``, most recently used first (at most ``limit``)."""
        stored = self._keys.get(int(key))
        if stored is None:
            return []
        paths = list(reversed(stored))
        return paths if limit is None else paths[:limit]

    def __len__(self) -> int:
        return sum(len(stored) for stored in self._keys.values())

    def __contains__(self, ngram: Iterable[int]) -> bool:
        ngram = tuple(int(x) for x in ngram)
        stored = self._keys.get(ngram[0])
        return stored is not None and ngram[1:] in stored


class SharedPool:
    """Continuations seen in earlier sequences, looked up by the context's longest suffix: a
    server's *warm pool*, shared by every request.

    Finished sequences (prompt and output) are added whole: after each suffix of 1 to
    ``max_suffix`` tokens, the ``span`` tokens that followed it are kept (at most ``per_key``
    continuations per suffix, newest first). The pool is bounded by ``max_entries`` (suffix,
    continuation) pairs and by an estimate of their memory, ``max_bytes``; the least recently
    used pairs go first. Lookups only propose candidates, which the model verifies, so the pool
    can change the speed of a sequence but never its text.

    >>> shared = SharedPool(max_suffix=2, span=2)
    >>> shared.add_text([5, 6, 7, 8])
    >>> shared.candidates([1, 6, 7], length=2, limit=2)    # "6 7" was followed by 8
    [(8,)]
    >>> shared.match_length([1, 6, 7])
    2
    """

    # estimated bytes per pair beyond its tokens: its slots in both dicts, two tuples, and where
    # suffixes rarely repeat (the worst case) an OrderedDict per suffix; measured with tracemalloc
    # on random 49k-vocabulary text (tests/test_pool.py): 620-780 bytes a pair of ~10 tokens
    ENTRY_BYTES = 700
    TOKEN_BYTES = 8

    def __init__(
        self,
        max_entries: int = 500_000,
        max_bytes: int = 128 * 2**20,
        max_suffix: int = 3,
        span: int = 8,
        per_key: int = 4,
    ) -> None:
        if min(max_entries, max_bytes, max_suffix, span, per_key) < 1:
            raise ValueError("SharedPool bounds must all be at least 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.max_suffix, self.span, self.per_key = max_suffix, span, per_key
        self._lru: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], None] = OrderedDict()  # oldest first
        self._by_suffix: dict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = {}
        self.nbytes = 0

    def _size(self, suffix: tuple[int, ...], continuation: tuple[int, ...]) -> int:
        return self.ENTRY_BYTES + self.TOKEN_BYTES * (len(suffix) + len(continuation))

    def _insert(self, suffix: tuple[int, ...], continuation: tuple[int, ...]) -> None:
        pair = (suffix, continuation)
        conts = self._by_suffix.setdefault(suffix, OrderedDict())
        if pair in self._lru:
            self._lru.move_to_end(pair)
            conts.move_to_end(continuation)
            return
        self._lru[pair] = None
        conts[continuation] = None
        self.nbytes += self._size(suffix, continuation)
        if len(conts) > self.per_key:
            self._remove((suffix, next(iter(conts))))
        while len(self._lru) > self.max_entries or self.nbytes > self.max_bytes:
            self._remove(next(iter(self._lru)))

    def _remove(self, pair: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        suffix, continuation = pair
        del self._lru[pair]
        conts = self._by_suffix[suffix]
        del conts[continuation]
        if not conts:
            del self._by_suffix[suffix]
        self.nbytes -= self._size(suffix, continuation)

    def empty_like(self) -> SharedPool:
        """An empty pool with this one's bounds."""
        return SharedPool(self.max_entries, self.max_bytes, self.max_suffix, self.span, self.per_key)

    def add_text(self, tokens: Sequence[int], start: int = 0, stop: int | None = None) -> None:
        """Keep what followed every suffix of ``tokens`` (a prompt and its output) that ends at a
        position in ``start`` .. ``stop`` - 1: a long text can go in over several calls, with the
        same result as one."""
        tokens = [int(t) for t in tokens]
        stop = len(tokens) - 1 if stop is None else min(stop, len(tokens) - 1)
        for end in range(start, stop):
            continuation = tuple(tokens[end + 1 : end + 1 + self.span])
            for m in range(1, min(self.max_suffix, end + 1) + 1):
                self._insert(tuple(tokens[end - m + 1 : end + 1]), continuation)

    def match_length(self, tokens: Sequence[int]) -> int:
        """Length of the longest suffix of ``tokens`` (up to ``max_suffix``) that the pool knows."""
        for m in range(min(self.max_suffix, len(tokens)), 0, -1):
            if tuple(tokens[len(tokens) - m :]) in self._by_suffix:
                return m
        return 0

    def candidates(self, tokens: Sequence[int], length: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of at most ``length`` tokens after the context's
        suffix, longest suffix first, newest first."""
        found: list[tuple[int, ...]] = []
        for m in range(min(self.max_suffix, len(tokens)), 0, -1):
            conts = self._by_suffix.get(tuple(tokens[len(tokens) - m :]))
            for continuation in reversed(conts or ()):
                continuation = continuation[:length]
                if continuation and continuation not in found:
                    found.append(continuation)
                    if len(found) >= limit:
                        return found
        return found

    def __len__(self) -> int:
        return len(self._lru)


class PoolFeed:
    """Finished texts on their way into warm pools, a bounded number of text positions per call of
    :meth:`feed`: a long text goes in over several calls (a server's steps), with the same result
    as one ``add_text`` (32k tokens took 205 ms at once on a 2-core CPU, a stall of every stream).

    >>> feed, shared = PoolFeed(), SharedPool(max_suffix=1, span=1)
    >>> feed.add(shared, [5, 6, 7]); feed.feed(1); shared.candidates([5], 1, 1), bool(feed)
    ([(6,)], True)
    """

    def __init__(self) -> None:
        self._queue: deque[list] = deque()  # [pool, tokens, positions already in]

    def add(self, pool: SharedPool, tokens: Sequence[int]) -> None:
        self._queue.append([pool, list(tokens), 0])

    def feed(self, budget: int) -> None:
        """Add the next ``budget`` positions of the queued texts, oldest first."""
        while self._queue and budget > 0:
            entry = self._queue[0]
            pool, tokens, start = entry
            stop = min(start + budget, len(tokens))
            pool.add_text(tokens, start=start, stop=stop)
            budget -= stop - start
            entry[2] = stop
            if stop >= len(tokens):
                self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)
