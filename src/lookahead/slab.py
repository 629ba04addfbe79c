"""One tensor for every layer's keys and values: a step's cache moves cost two kernels in all.

A ``DynamicCache`` keeps each layer's keys and values as tensors of their own, grown by
``torch.cat`` (a copy of the whole layer) every forward pass. Lookahead keeps, after each step,
only the accepted entries of the step region, moved to its front (``lookahead.runner``); with
separate tensors that is two kernels per tensor per layer (120 for a 30-layer model) whenever a
sequence accepted anything but the first chain of its step.

A :class:`Slab` holds all of them in one preallocated tensor ``[2 * layers, B, H, capacity, D]``
(keys of layer i at ``2i``, values at ``2i + 1``), and each layer of the cache is a
:class:`SlabLayer`, a ``DynamicLayer`` whose keys and values are views of it. A forward pass
writes its new entries in place (no copy of the past), a crop only moves the layer's end, and the
step's moves are one ``index_select`` and one ``index_copy_`` over the rows of every layer at once.
The capacity grows by half when a forward pass needs more (one copy of what is held).

It needs every layer's keys and values to share one shape (most decoder-only models; not those
whose keys and values differ in width, nor sliding-window layers that drop columns, which keep
their own tensors: ``DecoderRunner`` falls back to them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

HEADROOM = 64  # columns allocated beyond what is held, at least


def uniform_shape(cache) -> tuple[int, int, int, torch.dtype] | None:
    """(layers, heads, head dim, dtype) of a filled DynamicCache whose plain layers all hold keys
    and values of one shape [B, heads, C, head dim] and dtype: what a slab can hold; else None."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return None
    kinds = {(tuple(t.shape), t.dtype) for layer in layers for t in (layer.keys, layer.values)}
    if len(kinds) != 1 or len(next(iter(kinds))[0]) != 4:
        return None
    (_, heads, _, dim), dtype = next(iter(kinds))
    return len(layers), heads, dim, dtype


class SlabLayer(DynamicLayer):
    """A cache layer whose keys and values are views of ``slab`` (columns ``slab.start`` to its own
    ``end``); writes go in place. Each layer keeps its own end, since a forward pass updates the
    layers one after another."""

    def __init__(self, slab: Slab, index: int, end: int) -> None:
        self.slab, self.index, self.end = slab, index, end
        super().__init__()
        self.is_initialized = True
        self.device = slab.data.device

    # DynamicLayer's methods read and assign ``keys`` and ``values``: views made when read, and
    # the assignments of the base class's __init__ are ignored
    @property
    def keys(self) -> torch.Tensor:
        return self.slab.data[2 * self.index, : self.slab.batch, :, self.slab.start : self.end]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("a SlabLayer's keys live in its slab: write through update() or the Slab")

    @property
    def values(self) -> torch.Tensor:
        return self.slab.data[2 * self.index + 1, : self.slab.batch, :, self.slab.start : self.end]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("a SlabLayer's values live in its slab: write through update() or the Slab")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length = key_states.shape[-2]
        if self.end + length > self.slab.capacity:
            self.slab.grow(self.end + length)
        data, at, batch = self.slab.data, self.end, self.slab.batch
        data[2 * self.index, :batch, :, at : at + length].copy_(key_states)
        data[2 * self.index + 1, :batch, :, at : at + length].copy_(value_states)
        self.end = at + length
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.slab.start

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the number of tokens to remove")
        self.end = max(self.slab.start, self.end + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("select the sequences of a slab with Slab.select (every layer at once)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a slab's batch changes through Slab.select and Slab.reorder only")

    def reset(self) -> None:
        raise NotImplementedError("a slab's layers are not reset: hand the cache back (Slab.detach) first")

    def offload(self) -> None:
        raise NotImplementedError("a slab's layers are not offloaded")


class Slab:
    """The keys and values of every layer of a cache in one tensor (see the module docstring).

    The tensor may hold more sequences than the batch has (``batch`` are in use, the first ones)
    and more columns than are held (``start`` to each layer's end): sequences that leave are
    overwritten by those after them and newcomers take free rows, in place, so that a server's
    comings and goings allocate nothing (a fresh tensor of tens of MB costs its page faults)."""

    def __init__(self, data: torch.Tensor, start: int, end: int) -> None:
        self.data = data  # [2 * layers, rows >= batch, H, capacity, D]
        self.batch = data.shape[1]  # sequences in use: rows 0 .. batch - 1
        self.start = start  # first column held (columns before it were cut)
        self._base, self._base_shape = None, None  # move()'s row offsets, for one shape of data
        self.layers = [SlabLayer(self, i, end) for i in range(data.shape[0] // 2)]

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def end(self) -> int:
        return self.layers[0].end

    @classmethod
    def empty(cls, layers: int, batch: int, heads: int, dim: int, length: int, dtype, device) -> Slab:
        """A slab of ``layers`` layers holding nothing yet, with room for ``length`` columns and the
        headroom, for a prefill to write into (its SlabLayers replace a fresh cache's layers), so
        that the prompt's keys and values are written once, not copied over afterwards."""
        data = torch.empty(2 * layers, batch, heads, length + HEADROOM, dim, dtype=dtype, device=device)
        return cls(data, 0, 0)

    def _reallocate(self, rows: int, left: int, columns: int) -> None:
        """A new tensor of ``rows`` sequences and ``columns`` columns, held from column 0; what is
        held now moves there, ``left`` columns in (zeros before it: holes)."""
        held = self.end - self.start
        tensors, _, heads, _, dim = self.data.shape
        make = self.data.new_zeros if left else self.data.new_empty
        data = make(tensors, rows, heads, columns, dim)
        data[:, : self.batch, :, left : left + held] = self.data[:, : self.batch, :, self.start : self.end]
        for layer in self.layers:
            layer.end += left - self.start
        self.data, self.start = data, 0

    def admit(self, newcomers) -> None:
        """Append the sequences of ``newcomers`` (a DynamicCache whose layers have this slab's
        shape) to the batch: both are right-aligned on the longer, the shorter left-padded with
        zeros (holes, which the mask hides). In place where the tensor has the rows and the
        columns; else one copy of what is held into a larger one."""
        count, theirs = newcomers.layers[0].keys.shape[0], newcomers.layers[0].keys.shape[2]
        _, _, heads, _, dim = self.data.shape
        expected = (count, heads, theirs, dim)
        if len(newcomers.layers) != len(self.layers) or any(
            tuple(t.shape) != expected for layer in newcomers.layers for t in (layer.keys, layer.values)
        ):  # checked before anything is written: a failed admission leaves the slab as it was
            raise ValueError(f"the newcomers' cache does not fit this slab's layers of {expected}")
        held, batch = self.end - self.start, self.batch
        extra = max(0, theirs - held)  # columns the running sequences gain on the left (holes)
        if batch + count > self.data.shape[1] or extra > self.start:
            self._reallocate(batch + count, extra, max(held, theirs) + HEADROOM)
        elif extra:
            self.start -= extra
            self.data[:, :batch, :, self.start : self.start + extra] = 0
        rows = self.data[:, batch : batch + count]
        rows[:, :, :, self.start : self.end - theirs] = 0
        for i, layer in enumerate(newcomers.layers):
            rows[2 * i, :, :, self.end - theirs : self.end] = layer.keys
            rows[2 * i + 1, :, :, self.end - theirs : self.end] = layer.values
        self.batch = batch + count

    def grow(self, needed: int) -> None:
        """Room for ``needed`` columns (counted from column 0 of the current data), and half as many
        again: what is held is copied to the front of a new tensor."""
        held = max(layer.end for layer in self.layers) - self.start
        capacity = max(needed - self.start + HEADROOM, (needed - self.start) * 3 // 2)
        tensors, _, heads, _, dim = self.data.shape
        data = self.data.new_empty(tensors, self.data.shape[1], heads, capacity, dim)
        data[:, : self.batch, :, :held] = self.data[:, : self.batch, :, self.start : self.start + held]
        for layer in self.layers:
            layer.end -= self.start
        self.data, self.start = data, 0

    def select(self, keep: Sequence[int], lead: int = 0) -> None:
        """Keep the sequences ``keep`` (increasing indices into the batch) and cut the first
        ``lead`` columns held (holes in every kept sequence), in place: each kept sequence after
        a gap moves up one row (a copy of what it holds), and the cut only moves ``start``."""
        self.start += lead
        for to, sequence in enumerate(keep):
            if sequence != to:
                self.data[:, to, :, self.start : self.end] = self.data[:, sequence, :, self.start : self.end]
        self.batch = len(keep)

    def reorder(self, rows: Sequence[int]) -> None:
        """Row j becomes a copy of row ``rows[j]`` (rows may repeat: beam search's reorder), in
        place: only the rows that change are written, from a copy of their sources taken first,
        every layer at once (where a DynamicCache copies every row of every layer). The batch then
        has ``len(rows)`` sequences: more than the tensor holds makes a larger one first."""
        if len(rows) > self.data.shape[1]:
            self._reallocate(len(rows), 0, self.capacity - self.start)
        self.batch = len(rows)
        moved = [j for j, row in enumerate(rows) if row != j]
        if not moved:
            return
        device = self.data.device
        to = torch.tensor(moved).to(device, non_blocking=True)
        source = torch.tensor([rows[j] for j in moved]).to(device, non_blocking=True)
        held = self.data[:, :, :, self.start : self.end]
        held[:, to] = held[:, source]

    def move(self, step_length: int, moves: Sequence[tuple[int, int, int]]) -> None:
        """Within the last ``step_length`` columns held (the step region), copy entries: ``moves``
        lists (sequence, to column, from column), columns counted from the region's start; every
        layer's keys and values at once (one index_select, one index_copy_). Every source is read
        before any destination is written."""
        if not moves:
            return
        tensors, rows, heads, capacity, dim = self.data.shape
        if self._base_shape != self.data.shape:  # row of (tensor, sequence 0, head, column 0), [T, 1, H]
            base = (torch.arange(tensors)[:, None] * (rows * heads) + torch.arange(heads)[None]) * capacity
            self._base, self._base_shape = base[:, None, :].to(self.data.device, non_blocking=True), self.data.shape
        past, per_sequence = self.end - step_length, heads * capacity
        offsets = [
            [b * per_sequence + past + at for b, _, at in moves],
            [b * per_sequence + past + at for b, at, _ in moves],
        ]
        offsets = torch.tensor(offsets).to(self.data.device, non_blocking=True)  # [2, M]: from, to
        from_rows, to_rows = (self._base[None] + offsets[:, None, :, None]).view(2, -1)  # [2, T * M * H]
        flat = self.data.view(-1, dim)
        flat.index_copy_(0, to_rows, flat.index_select(0, from_rows))

    def detach(self, cache) -> None:
        """Give ``cache`` plain DynamicLayers again, with their own (contiguous) copies: for a cache
        handed back to the caller, who may grow, crop or reorder it as transformers does."""
        layers = []
        for slab_layer in self.layers:
            layer = DynamicLayer()
            layer.lazy_initialization(slab_layer.keys, slab_layer.values)
            layer.keys, layer.values = slab_layer.keys.clone(), slab_layer.values.clone()
            layers.append(layer)
        cache.layers[:] = layers
