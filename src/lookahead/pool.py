"""The n-gram pool: candidate continuations keyed by their first token.

Each key (a token id) owns a trie of the n-1 tokens that followed it. Shared prefixes are stored
once, a repeated n-gram is not stored twice, and each key keeps at most ``capacity`` n-grams: the
least recently inserted or refreshed one is evicted first (LRU). The pool holds no model.

Example (n=3, capacity=2)::

    >>> pool = NGramPool(ngram_size=3, capacity=2)
    >>> pool.add((7, 1, 2)); pool.add((7, 1, 3)); pool.add((7, 1, 2))  # refreshes (1, 2)
    >>> pool.candidates(7)            # most recent first
    [(1, 2), (1, 3)]
    >>> pool.add((7, 4, 5))           # evicts (1, 3), the least recently used
    >>> pool.candidates(7)
    [(4, 5), (1, 2)]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class _KeyTrie:
    """The continuations of one key: a trie for shared prefixes plus an LRU order of its leaves."""

    __slots__ = ("root", "order")

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.order: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first

    def insert(self, path: tuple[int, ...], capacity: int) -> None:
        if path in self.order:
            self.order.move_to_end(path)
            return
        node = self.root
        for token in path:
            node = node.setdefault(token, {})
        self.order[path] = None
        while len(self.order) > capacity:
            oldest, _ = self.order.popitem(last=False)
            self._remove(oldest)

    def _remove(self, path: tuple[int, ...]) -> None:
        # walk down remembering parents, then prune nodes that became empty
        trail = [self.root]
        for token in path[:-1]:
            trail.append(trail[-1][token])
        for depth in range(len(path) - 1, -1, -1):
            node = trail[depth]
            if node[path[depth]]:  # the child still has other continuations below it
                break
            del node[path[depth]]

    def node_count(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node)
            stack.extend(node.values())
        return count


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
        self._tries: dict[int, _KeyTrie] = {}

    def add(self, ngram: Sequence[int]) -> None:
        """Insert (or refresh) one n-gram of exactly ``ngram_size`` tokens."""
        if len(ngram) != self.ngram_size:
            raise ValueError(f"expected an n-gram of {self.ngram_size} tokens, got {len(ngram)}")
        key = int(ngram[0])
        trie = self._tries.get(key)
        if trie is None:
            trie = self._tries[key] = _KeyTrie()
        trie.insert(tuple(int(x) for x in ngram[1:]), self.capacity)

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Insert every n-gram of ``tokens`` that ends at index ``start + n - 1`` or later, in order."""
        n = self.ngram_size
        for i in range(max(0, start), len(tokens) - n + 1):
            self.add(tokens[i : i + n])

    def candidates(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The continuations stored for ``key``, most recently used first (at most ``limit``)."""
        trie = self._tries.get(int(key))
        if trie is None:
            return []
        paths = list(reversed(trie.order))
        return paths if limit is None else paths[:limit]

    def __len__(self) -> int:
        return sum(len(t.order) for t in self._tries.values())

    def __contains__(self, ngram: Iterable[int]) -> bool:
        ngram = tuple(int(x) for x in ngram)
        trie = self._tries.get(ngram[0])
        return trie is not None and ngram[1:] in trie.order

    def trie_size(self, key: int) -> int:
        """Number of trie nodes under ``key`` (shared prefixes count once)."""
        trie = self._tries.get(int(key))
        return 0 if trie is None else trie.node_count()
