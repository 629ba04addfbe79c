"""The token layout of one lookahead step: which slots exist, where they sit, and what each sees.

One forward pass holds three parts, in this order (W=5, N=4, G=2, one prefix token ``t``)::

    slot:       t | level 0     | level 1       | level 2       | cand 0 | cand 1
    column:     0 | 1  2  3  4  | 0  1  2  3  4 | 0  1  2  3  4 | -      | -
    position:   0 | 1  2  3  4  | 1  2  3  4  5 | 2  3  4  5  6 | 1 2 3  | 1 2 3
                  (positions relative to p, the position of t)

What each slot sees inside the step (every slot also sees the whole KV cache):

* the prefix (the committed tokens that are not cached yet; ``t`` is its last) is causal;
* level 0, column c sees the prefix and level-0 columns 1..c;
* level l, column c sees the prefix, level-0 columns 1..c and column c of levels 1..l
  (column 0 of level 0 *is* t, so a column reads as one contiguous run of positions);
* candidate k, token j sees the prefix and tokens 0..j of candidate k.

Nothing crosses between the lookahead and verification branches, or between candidates (but
candidates sharing a prefix may share its slots, below).

**Token tree.** Candidates that share a prefix may share its slots (``shape``, see
:func:`tree_shape`): ``(5, 9)`` and ``(5, 6)`` become the slots ``5 -> 9`` and ``5 -> 6``, with
one slot for the shared 5. A node slot sees the prefix, its ancestors and itself, so each path
through the tree reads exactly as its candidate would alone, and a shared prefix costs one slot::

    candidates (5, 9, 2), (5, 6, 1), (7, 3, 3)  ->  nodes 5 9 2 6 1 7 3 3  (8 slots, not 9)
    shape = ((0, 1, 2), (0, 3, 4), (5, 6, 7))

Mask of the example above (``x`` = may attend, slots and columns in input order)::

             t  l0 . . .  l1 . . . .  l2 . . . .  c0 . .  c1 . .
      t      x
      l0c1   x  x
      l0c2   x  x x
      l0c3   x  x x x
      l0c4   x  x x x x
      l1c0   x            x
      l1c1   x  x           x
      ...
      l2c1   x  x           x           x
      c0j0   x                                    x
      c0j1   x                                    x x
      c1j0   x                                            x
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .support import additive_mask


@dataclass(frozen=True)
class StepLayout:
    """Where every part of one step sits in the input. Built by :func:`build_layout`."""

    positions: torch.Tensor  # [L] int64, relative to the position of t
    mask: torch.Tensor  # [L, L] bool, True where a slot may attend to a column
    t_slot: int  # slot of t, the last prefix token
    last_level_slots: tuple[int, ...]  # W slots whose outputs form the next window level
    level_slots: tuple[tuple[int, ...], ...]  # slots of each filled level (level 0 excludes t)
    candidate_slots: tuple[tuple[int, ...], ...]  # [g][len of candidate k]: its slots, shared prefixes shared
    length: int  # L
    logit_slots: torch.Tensor  # [K] sorted slots whose logits are used: t, last level, candidates
    logit_index: dict[int, int]  # slot -> index into logit_slots
    candidate_position: dict[int, tuple[int, int]]  # candidate slot -> (first candidate k using it, token j)
    node_slots: tuple[int, ...]  # slots of the verification branch, by node id (see ``shape``)
    reach: int = 0  # the highest position, relative to t's
    # what the runner derives from this layout for a device and dtype, made once (see ``on_device``)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def on_device(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [L], the in-step mask as additive floats [L, L] (0 = attend, dtype min =
        blocked), logit_slots [K]) on ``device``: made on the first step that uses this layout
        there and kept with it, so that later steps copy nothing to the device for them."""
        key = (device, dtype)
        if key not in self._derived:
            with torch.inference_mode(False):  # kept across calls: see build_layout
                step_mask = additive_mask(self.mask, dtype)
                # non-blocking: the driver stages pageable memory before returning, and the host never waits
                self._derived[key] = tuple(
                    t.to(device, non_blocking=True) for t in (self.positions, step_mask, self.logit_slots)
                )
        return self._derived[key]


Shape = tuple[tuple[int, ...], ...]  # node id of token j of candidate k, ids numbered 0.. in input order


def chain_shape(n_candidates: int, candidate_len: int) -> Shape:
    """Every candidate on slots of its own (no sharing)."""
    return tuple(tuple(range(k * candidate_len, (k + 1) * candidate_len)) for k in range(n_candidates))


def tree_shape(candidates: Sequence[Sequence[int]]) -> Shape:
    """Candidates merged into a token tree: one node per distinct prefix, numbered as first met
    (so a node's parent always comes before it)."""
    nodes: dict[tuple[int, ...], int] = {}
    return tuple(
        tuple(nodes.setdefault(tuple(candidate[: j + 1]), len(nodes)) for j in range(len(candidate)))
        for candidate in candidates
    )


def node_tokens(candidates: Sequence[Sequence[int]], shape: Shape) -> list[int]:
    """The input token of each node of ``shape``."""
    tokens: dict[int, int] = {}
    for candidate, ids in zip(candidates, shape, strict=True):
        for token, node in zip(candidate, ids, strict=True):
            tokens.setdefault(node, int(token))
    return [tokens[node] for node in range(len(tokens))]


@lru_cache(maxsize=1024)
def build_layout(
    n_prefix: int,
    window: int,
    n_levels: int,
    n_candidates: int = 0,
    candidate_len: int = 0,
    shape: Shape | None = None,
) -> StepLayout:
    """Lay out one step: ``n_prefix`` uncached tokens (the last is t), ``n_levels`` filled levels
    of a window of ``window`` columns, and the verification branch: ``n_candidates`` candidates
    of ``candidate_len`` tokens on slots of their own, or the token tree ``shape`` (which then
    replaces both; see :func:`tree_shape`).

    Pure and cached: the same arguments return the same (read-only) tensors. They are made as
    normal tensors even under ``torch.inference_mode`` (a server's engine thread): a layout first
    built there is reused by later calls, and an inference tensor cannot enter a computation that
    autograd records.
    """
    with torch.inference_mode(False):
        return _build_layout(n_prefix, window, n_levels, n_candidates, candidate_len, shape)


def _build_layout(n_prefix, window, n_levels, n_candidates, candidate_len, shape) -> StepLayout:
    if n_prefix < 1:
        raise ValueError("a step needs at least one prefix token (t)")
    if window == 0:
        n_levels = 0
    if shape is None:
        shape = chain_shape(n_candidates, candidate_len) if n_candidates and candidate_len else ()
    shape = tuple(ids for ids in shape if ids)
    parent = _tree_parents(shape)
    n_nodes = len(parent)

    positions: list[int] = list(range(-(n_prefix - 1), 1))
    t_slot = n_prefix - 1
    # sees[r] is the set of in-step slots that slot r may attend to (itself included).
    sees: list[set[int]] = [set(range(r + 1)) for r in range(n_prefix)]
    prefix = set(range(n_prefix))

    level_slots = _place_window(positions, sees, prefix, window, n_levels)

    node_slots: list[int] = []
    for node in range(n_nodes):
        slot = len(positions)
        up = parent[node]
        node_slots.append(slot)
        positions.append(positions[node_slots[up]] + 1 if up is not None else 1)
        sees.append((sees[node_slots[up]] if up is not None else prefix) | {slot})
    candidate_slots = [tuple(node_slots[node] for node in ids) for ids in shape]

    length = len(positions)
    mask = torch.zeros(length, length, dtype=torch.bool)
    rows = [slot for slot, visible in enumerate(sees) for _ in visible]
    mask[rows, [column for visible in sees for column in visible]] = True  # one write for all slots

    if n_levels == 0:
        last_level: tuple[int, ...] = ()
    elif n_levels == 1:
        last_level = (t_slot, *level_slots[0])  # column 0 of level 0 is t itself
    else:
        last_level = level_slots[-1]
    used = sorted({t_slot, *last_level, *(r for cand in candidate_slots for r in cand)})
    return StepLayout(
        positions=torch.tensor(positions, dtype=torch.long),
        mask=mask,
        t_slot=t_slot,
        last_level_slots=last_level,
        level_slots=tuple(level_slots),
        candidate_slots=tuple(candidate_slots),
        length=length,
        logit_slots=torch.tensor(used, dtype=torch.long),
        logit_index={slot: i for i, slot in enumerate(used)},
        candidate_position={
            r: (k, j) for k, cand in reversed(list(enumerate(candidate_slots))) for j, r in enumerate(cand)
        },
        node_slots=tuple(node_slots),
        reach=max(positions),
    )


def _tree_parents(shape: tuple[tuple[int, ...], ...]) -> dict[int, int | None]:
    """Each token-tree node's parent (None for a first token), checked: one parent per node, nodes
    numbered 0.. with every parent before its children."""
    parent: dict[int, int | None] = {}
    for ids in shape:
        for j, node in enumerate(ids):
            if parent.setdefault(node, ids[j - 1] if j else None) != (ids[j - 1] if j else None):
                raise ValueError(f"node {node} of the token tree has two parents")
    n_nodes = 1 + max((node for ids in shape for node in ids), default=-1)
    if sorted(parent) != list(range(n_nodes)) or any(p is not None and p >= n for n, p in parent.items()):
        raise ValueError("token tree nodes must be numbered 0.. with every parent before its children")
    return parent


def _place_window(
    positions: list[int], sees: list[set[int]], prefix: set[int], window: int, n_levels: int
) -> list[tuple[int, ...]]:
    """Append the Jacobi window's slots, level by level, to ``positions`` and ``sees``; returns each
    level's slots. A level-0 slot sees the prefix and level 0 up to itself; a slot of a later level
    sees the prefix, level 0 left of its column, and its column's slots up to itself."""
    level_slots: list[tuple[int, ...]] = []
    level0: list[int] = []  # level-0 slots; level0[c - 1] is column c (column 0 is t)
    column: list[list[int]] = [[] for _ in range(window)]  # slots of levels 1.. in each column
    for level in range(n_levels):
        slots = []
        for col in range(1 if level == 0 else 0, window):
            slot = len(positions)
            positions.append(level + col)
            if level == 0:
                level0.append(slot)
                sees.append(prefix | set(level0))
            else:
                column[col].append(slot)
                sees.append(prefix | set(level0[:col]) | set(column[col]))
            slots.append(slot)
        level_slots.append(tuple(slots))
    return level_slots
