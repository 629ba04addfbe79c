"""Forward passes and the KV cache for a batch of sequences that advance unevenly.

A step feeds every active sequence the same layout (t, window, candidates), but each sequence accepts its
own number of tokens. For decoder-only models (:class:`DecoderRunner`) the cache stays exact with
holes, masked. Each step appends
``m = max_b kept_b`` cache columns to every sequence: sequence b moves its ``kept_b`` committed entries (t and its
accepted candidate tokens) to the front of the step's region, and the remaining ``m - kept_b``
columns become holes. ``key_pos`` [B, C] records each column's position (-1 for a hole or a left
pad); the 4D mask of the next step hides holes, and ``position_ids`` give each token its true
position, so a sequence never sees where the others are. Example: prompts a0..a3 and b0 b1, then
two steps (step 1 keeps 3 tokens of sequence a and 1 of sequence b, step 2 keeps 1 and 2; ``_`` is a left
pad, ``.`` a hole)::

    column:      0   1   2   3 |  4   5   6 |  7   8
    seq a:      a0  a1  a2  a3 | a4  a5  a6 | a7   .
    seq b:       _   _  b0  b1 | b2   .   . | b3  b4
    key_pos a:   0   1   2   3 |  4   5   6 |  7  -1
    key_pos b:  -1  -1   0   1 |  2  -1  -1 |  3   4
                   prefill     |   step 1   |  step 2

Only the entries not in place move, within the step's region, never the whole cache: where every
layer's keys and values share one shape they live in one tensor (``lookahead.slab``), and the
moves of all layers are two kernels; otherwise two per keys/values tensor. Holes cost
a few masked columns, and the leading columns that are holes in every sequence are cut whenever a
finished sequence is dropped. The model must take explicit
``position_ids`` and a custom 4D mask (``support.check_model`` probes for both). Sliding-window
layers get ``key > query - window`` on *positions*, not columns, and drop the leading columns
that no window reaches again, so their memory stays bounded (unless the cache is handed back to
the caller). Models that take no positions (ALiBi) run linear steps with a 2D mask instead,
which hides the holes while the model derives positions from it.

A sequence joins a running batch (:meth:`DecoderRunner.admit`) by a prefill of its own; then the
two caches are stacked, the shorter left-padded with hole columns.

Encoder-decoder models keep their sequences aligned instead: :mod:`lookahead.seq2seq_runner`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from .attention_switch import AS_THEY_ARE, CUDNN_OFF, leave_cudnn_out
from .host_inputs import id_rows, send
from .layout import StepLayout
from .media import MediaPrefill, shifted
from .slab import Slab
from .support import ModelTraits


class AdmissionError(RuntimeError):
    """The newcomers' own prefill failed (out of memory on a long prompt, ...), before anything of
    the running batch was touched: only they fail."""


def _src_slots(layout: StepLayout, picks: Sequence[tuple[int | None, int]], width: int) -> list[list[int]]:
    """For each sequence, the step slots whose cache entries it keeps (t first), padded to ``width``
    with the columns' own slots (they become holes, whatever they hold), so that a sequence that
    kept t and its first chain's leading tokens needs no move."""
    out = []
    for candidate, kept in picks:
        src = [layout.t_slot]
        if candidate is not None:
            src += list(layout.candidate_slots[candidate][: kept - 1])
        out.append(src + list(range(len(src), width)))
    return out


def _moves(src: list[list[int]]) -> list[tuple[int, int, int]]:
    """The entries of the step region that are not in place: (sequence, to slot, from slot)."""
    return [(b, j, slot) for b, kept in enumerate(src) for j, slot in enumerate(kept) if slot != j]


def _compact_step(layers, step_length: int, moves: list[tuple[int, int, int]]) -> None:
    """Move each sequence's kept entries of the step region (the last ``step_length`` columns of
    every layer) to its front, for caches whose layers have tensors of their own (a
    :class:`~lookahead.slab.Slab` moves every layer at once). Rows of D values are copied by one
    ``index_select`` and one ``index_copy_`` per keys/values tensor (a 4D gather costs several
    times more per call on a CPU), with row indices made once for all layers of the same device
    and shape."""
    if not moves:
        return  # already in place (t, then the first candidate or a linear chain)
    seqs, dst, slots = (torch.tensor(column) for column in zip(*moves, strict=True))  # [M] each
    rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, shape) -> (from, to) rows
    for layer in layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, C + L, D]
            if not states.is_contiguous():  # not seen with DynamicCache's layers: rows need one
                states = states.contiguous()
                setattr(layer, name, states)
            batch, heads, columns, dim = states.shape
            past = columns - step_length
            key = (states.device, tuple(states.shape))
            if key not in rows:  # row of (b, h, column) in the [B * H * (C + L), D] view
                base = (seqs[:, None] * heads + torch.arange(heads)[None]) * columns + past  # [M, H]
                rows[key] = tuple(send((base + at[:, None]).flatten(), states.device) for at in (slots, dst))
            from_rows, to_rows = rows[key]
            flat = states.view(-1, dim)
            flat.index_copy_(0, to_rows, flat.index_select(0, from_rows))


class _Keys:
    """A layer's keys and values, apart from any cache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values


def _left_pad(states: torch.Tensor, width: int, value) -> torch.Tensor:
    """``states`` [B, ...] left-padded with ``value`` along the columns (dim 2 for a layer's keys
    or values [B, H, C, D], dim 1 for key_pos [B, C]) to ``width``."""
    dim = 2 if states.dim() == 4 else 1
    missing = width - states.shape[dim]
    if missing == 0:
        return states
    shape = list(states.shape)
    shape[dim] = missing
    return torch.cat([states.new_full(shape, value), states], dim=dim)


def _n_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


class DecoderRunner:
    """Decoder-only models: one DynamicCache, holes masked (see the module docstring)."""

    aligned = False  # sequences may commit different numbers of tokens per step
    grows_by_reorder = True  # reorder() may copy rows into a larger batch (beam search's shared prefill)

    def __init__(self, model, spec: ModelTraits, bound_sliding: bool = True, slab: bool = True) -> None:
        self.model, self.spec = model, spec
        # read once: the model's device and dtype are properties that walk its parameters
        self.device, self.dtype = model.device, model.dtype
        self.cache = DynamicCache()
        self.slab: Slab | None = None  # every layer's keys and values in one tensor, where they fit
        # the bookkeeping lives on the host, so that reading it never waits for the device; a step
        # sends what the mask and positions need
        self.key_pos: torch.Tensor | None = None  # [B, C] (host) position of each cache column, -1 = hole
        self.n_cached: torch.Tensor | None = None  # [B] (host) committed tokens in the cache per sequence
        self.holes = False
        # [B, axes] (host) each row's position shift, None where none (a VLM's prompt: lookahead.media),
        # and whether the model takes its positions stacked [axes, B, L] (M-RoPE)
        self.shift: torch.Tensor | None = None
        self.stacked = False
        # sliding-window layers drop the leading columns no future query can see (bounded memory);
        # ``trim`` of them are gone from those layers (key_pos still lists them, for full layers)
        self.sliding = spec.sliding_layers(model.config) if bound_sliding else ()
        self.all_sliding = bool(self.sliding) and len(self.sliding) == _n_layers(model)
        self.trim = 0
        self.trimmed = False  # sliding layers have dropped columns: the model's own masks would not fit
        # sliding layers that drop columns keep tensors of their own; so do a newcomers' prefill
        self.use_slab = slab and not self.sliding
        # read when the call starts, so that a caller's own ``sdpa_kernel`` choice holds
        self.masked_attention = CUDNN_OFF if leave_cudnn_out() else AS_THEY_ARE

    def _logits_kwargs(self, slots: torch.Tensor | int) -> dict:
        return {"logits_to_keep": slots} if self.spec.keeps_logits else {}

    def prefill(self, prompts: Sequence[Sequence[int]], media: MediaPrefill | None = None) -> torch.Tensor:
        """Fill the cache with the prompts (left-padded, as transformers does) -> last logits [B, V].
        ``media``: a VLM's prefill, run as its generate runs it (:meth:`_prefill_media`)."""
        if media is not None:
            return self._prefill_media(prompts, media)
        device = self.device
        longest = max(len(p) for p in prompts)
        pads = [longest - len(p) for p in prompts]
        ids = send([[p[0]] * pad + list(p) for p, pad in zip(prompts, pads, strict=True)], device)
        key_pos = _left_padded_positions(pads, longest)
        self.cache = DynamicCache()  # a batch starting anew (the first, or after every sequence left)
        self.slab = self._empty_slab(len(prompts), longest)
        if self.slab is not None:  # the prefill writes straight into it
            self.cache.layers[:] = self.slab.layers
        self.holes = any(pads)
        # as transformers' prefill: a 2D padding mask (the model builds the causal part), pads at position 1
        mask = send((key_pos >= 0).long(), device) if self.holes else None
        positions = {"position_ids": send(key_pos.masked_fill(key_pos < 0, 1), device)} if self.spec.positions else {}
        out = self.model(
            input_ids=ids,
            **positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            **self._logits_kwargs(1),
        )
        self.key_pos, self.trim, self.trimmed = key_pos, 0, False
        self.n_cached = torch.tensor([len(p) for p in prompts])
        self.shift, self.stacked = None, False
        self._trim_sliding()
        return out.logits[:, -1]

    def _prefill_media(self, prompts: Sequence[Sequence[int]], media: MediaPrefill) -> torch.Tensor:
        """The prefill of a VLM's generate, its input_ids as given (``prompts`` are their rows
        without padding) -> last logits [B, V]; steps then add the position shift it reports."""
        width = media.input_ids.shape[1]
        pads = [width - len(p) for p in prompts]
        key_pos = _left_padded_positions(pads, width)
        self.cache, self.slab = DynamicCache(), None
        logits, self.shift, self.stacked = media.run(self.model, self.cache, self.spec.keeps_logits)
        self.key_pos, self.trim, self.trimmed, self.holes = key_pos, 0, False, any(pads)
        self.n_cached = torch.tensor([len(p) for p in prompts])
        self._trim_sliding()
        return logits

    def _empty_slab(self, batch: int, length: int) -> Slab | None:
        """A slab for a prefill of ``batch`` prompts of up to ``length`` tokens, where the model's
        cache fits one (``ModelTraits.cache_shape``, read off the model check's probe) in the
        model's dtype; else None (layers of their own)."""
        shape = self.spec.cache_shape
        if not self.use_slab or shape is None or shape[3] != self.dtype or shape[0] != _n_layers(self.model):
            return None
        layers, heads, dim, dtype = shape
        return Slab.empty(layers, batch, heads, dim, length, dtype, self.device)

    def admit(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefill ``prompts`` on their own, then append them to the running batch -> their last
        logits [b, V] (:meth:`apart`, then :meth:`merge`)."""
        newcomers, logits = self.apart(prompts)
        self.merge(newcomers)
        return logits

    def apart(
        self, prompts: Sequence[Sequence[int]], media: MediaPrefill | None = None
    ) -> tuple[DecoderRunner, torch.Tensor]:
        """A runner of their own for ``prompts`` (and ``media``, a VLM's prefill), prefilled ->
        (it, their last logits [b, V]). Raises :class:`AdmissionError`; nothing of this runner is
        touched."""
        newcomers = DecoderRunner(self.model, self.spec, bound_sliding=False, slab=False)
        try:
            return newcomers, newcomers.prefill(prompts, media)
        except Exception as err:
            raise AdmissionError(str(err)) from err

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Continue a lone sequence's prefill with its next ``tokens`` (a long prompt prefilled a
        chunk at a time between a server's steps) -> the last logits [1, V]. The first chunk is a
        plain :meth:`prefill`; later ones sit at the next positions, and the model builds the
        causal mask over its cache itself, as it does for a prefill."""
        if self.key_pos is None:
            return self.prefill([tokens])
        done = int(self.n_cached[0])
        if self.key_pos.shape[0] != 1 or self.holes or self.trimmed or self.shift is not None:
            raise ValueError("extend continues the text-only prefill of one sequence without holes")
        positions = torch.arange(done, done + len(tokens))
        extra = {"position_ids": send(positions[None], self.device)} if self.spec.positions else {}
        out = self.model(
            input_ids=send([list(tokens)], self.device),
            **extra,
            cache=self.cache,
            use_cache=True,
            **self._logits_kwargs(1),
        )
        self.key_pos = torch.cat([self.key_pos, positions[None]], dim=1)
        self.n_cached = self.n_cached + len(tokens)
        return out.logits[:, -1]

    def merge(self, newcomers: DecoderRunner) -> None:
        """Append the sequences of ``newcomers`` (a runner of their own, prefilled) to this batch.
        The shorter of the two caches is left-padded with holes, so every sequence keeps its
        columns and positions (the mask hides the holes). Every new tensor is made before any is
        kept, so a failure (out of memory, most likely) raises :class:`AdmissionError` with this
        batch as it was."""
        try:
            width = max(self.key_pos.shape[1], newcomers.key_pos.shape[1])
            key_pos = torch.cat([_left_pad(self.key_pos, width, -1), _left_pad(newcomers.key_pos, width, -1)])
            n_cached = torch.cat([self.n_cached, newcomers.n_cached])
            shift, stacked = _stacked_shifts(self, newcomers)
            if self.slab is not None:
                self.slab.admit(newcomers.cache)  # checks and allocates before it writes
            else:
                merged = [
                    [torch.cat([_left_pad(states, width, 0), _left_pad(getattr(theirs, name), width, 0)])
                     for name, states in (("keys", mine.keys), ("values", mine.values))]  # [B + b, H, width, D]
                    for mine, theirs in zip(self._untrimmed(), newcomers.cache.layers, strict=True)
                ]  # fmt: skip
        except Exception as err:
            raise AdmissionError(f"joining the running batch failed: {err}") from err
        if self.slab is None:
            for layer, (keys, values) in zip(self.cache.layers, merged, strict=True):
                layer.keys, layer.values = keys, values
            self.trim = 0
        self.key_pos, self.n_cached, self.shift, self.stacked = key_pos, n_cached, shift, stacked
        self.holes = bool((self.key_pos < 0).any())

    def adopt(self, newcomers: DecoderRunner) -> None:
        """Take ``newcomers``' sequences as the whole batch (nothing else is running): their
        cache moves into a slab where the model's cache fits one."""
        try:
            slab = self._empty_slab(newcomers.key_pos.shape[0], newcomers.key_pos.shape[1])
        except Exception as err:
            raise AdmissionError(f"joining the running batch failed: {err}") from err
        cache = newcomers.cache
        if slab is not None:
            for mine, theirs in zip(slab.layers, newcomers.cache.layers, strict=True):
                mine.update(theirs.keys, theirs.values)
            cache = DynamicCache()
            cache.layers[:] = slab.layers
        self.cache, self.slab = cache, slab
        self.key_pos, self.n_cached, self.holes = newcomers.key_pos, newcomers.n_cached, newcomers.holes
        self.shift, self.stacked = newcomers.shift, newcomers.stacked
        self.trim, self.trimmed = 0, False
        self._trim_sliding()

    def step(self, layout: StepLayout, step_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward pass over every sequence's step -> the used slots' logits [B, K, V]."""
        device, dtype = self.device, self.dtype
        step_positions, step_mask, slots = layout.on_device(device, dtype)  # [L], [L, L], [K]
        positions = step_positions[None] + send(self.n_cached[:, None], device)  # [B, L]
        positions = self._within_limits(positions, layout.reach)
        # t alone with no hole to hide: let the model build its own mask, exactly as plain decoding
        # (the same attention kernel, hence the same rounding)
        if layout.length == 1 and not self.holes and not self.trimmed:
            mask = None
        elif self.spec.positions:
            key_pos = send(self.key_pos, device)
            mask = self.spec.build(step_mask, key_pos, positions, dtype, self.trim)
        else:  # linear steps: a 2D mask hides the holes; the model derives positions and causality
            ones = self.key_pos.new_ones(len(step_ids), layout.length)
            mask = send(torch.cat([(self.key_pos >= 0).long(), ones], dim=1), device)  # [B, C + L]
        extra = {"position_ids": shifted(positions, self.shift, self.stacked)} if self.spec.positions else {}
        with self.masked_attention if mask is not None else AS_THEY_ARE:  # see leave_cudnn_out
            out = self.model(
                input_ids=send(id_rows(step_ids), device),
                **extra,
                attention_mask=mask,
                cache=self.cache,
                use_cache=True,
                **self._logits_kwargs(slots),
            )
        return out.logits if self.spec.keeps_logits else out.logits[:, slots]

    def _within_limits(self, positions: torch.Tensor, reach: int) -> torch.Tensor:
        """Positions past what a sequence's step may reach (``ModelTraits.position_limit``: the
        position table's end, a RoPE threshold) held at that limit. Only filler slots get there (a
        batch shares one layout, so a sequence near its limit carries the longest chain's slots);
        their outputs are never read, while their positions would index past a learned table or
        change every token's rotary frequencies."""
        spec = self.spec
        limit = spec.context_limit  # no sequence's limit is below limit - 1 (ModelTraits.position_limit)
        if limit is None:
            return positions
        t_positions = self.n_cached.tolist()
        if max(t_positions) + reach < limit:  # every step far from its limits: one comparison
            return positions
        highest = [spec.position_limit(p) for p in t_positions]
        big = torch.iinfo(torch.long).max
        caps = torch.tensor([big if h is None else h for h in highest])[:, None]
        return torch.minimum(positions, send(caps, positions.device))

    def commit(self, layout: StepLayout, picks: Sequence[tuple[int | None, int]]) -> None:
        """Keep, per sequence, t and its first ``kept - 1`` accepted candidate tokens: picks[b] =
        (accepted candidate or None, tokens kept >= 1)."""
        width = max(kept for _, kept in picks)
        moves = _moves(_src_slots(layout, picks, width))
        if self.slab is not None:
            self.slab.move(layout.length, moves)
        else:
            _compact_step(self.cache.layers, layout.length, moves)
        self.cache.crop(-(layout.length - width))
        counts = [k for _, k in picks]
        before = list(zip(self.n_cached.tolist(), counts, strict=True))
        # the step's kept columns: positions of the kept entries, then holes (-1), per sequence
        new_pos = torch.tensor([[n + j if j < k else -1 for j in range(width)] for n, k in before])
        self.key_pos = torch.cat([self.key_pos, new_pos], dim=1)
        self.n_cached = torch.tensor([n + k for n, k in before])
        self.holes = self.holes or any(k < width for k in counts)  # read on the host: no device sync
        self._trim_sliding()

    @property
    def columns(self) -> int:
        """Cache columns per sequence (holes included): what every query of a step attends over."""
        return 0 if self.key_pos is None else self.key_pos.shape[1]

    def hand_back(self) -> DynamicCache:
        """The cache, for the caller of ``generate``: plain DynamicLayers again (see
        :meth:`lookahead.slab.Slab.detach`); the runner is done with it."""
        if self.slab is not None:
            self.slab.detach(self.cache)
            self.slab = None
        return self.cache

    def _trim_sliding(self) -> None:
        """Drop, from sliding-window layers, the leading columns that no sequence can see again
        (holes, or keys at or before n_cached - window, since every later query sits at n_cached
        or after): their memory stays bounded by the window plus a step."""
        if not self.sliding:
            return
        horizon = self.n_cached - self.spec.sliding_window + 1  # [B] oldest position still visible
        dead = (self.key_pos[:, self.trim :] < horizon[:, None]).all(dim=0)  # [C - trim]
        lead = int(dead.long().cumprod(0).sum())
        if lead == 0:
            return
        self.trimmed = True
        for i in self.sliding:
            layer = self.cache.layers[i]
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        if self.all_sliding:  # no layer needs those columns: forget them altogether
            self.key_pos = self.key_pos[:, lead:]
        else:
            self.trim += lead

    def _untrimmed(self) -> list:
        """Every layer as it would be with the columns sliding layers dropped given back, as
        zeros: before sequences of other lengths join, every layer must span the same columns. No
        one can see them (they were dropped because they lay beyond every window), so zeros are as
        good as the keys were. Made apart (``_Keys`` pairs), for :meth:`merge` to keep."""
        layers = []
        for i, layer in enumerate(self.cache.layers):
            keys, values = layer.keys, layer.values  # [B, H, C - trim, D] for a trimmed sliding layer
            if self.trim and i in self.sliding:
                keys, values = (
                    torch.cat([t.new_zeros(t.shape[0], t.shape[1], self.trim, t.shape[3]), t], dim=2)
                    for t in (keys, values)
                )
            layers.append(_Keys(keys, values))
        return layers

    def reorder(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row ``rows[i]`` (rows may repeat: beam search's reorder), and the
        batch has ``len(rows)`` rows: more than before copies prompts into new rows (beam search's
        shared prefill). A slab rewrites only the rows that change (:meth:`lookahead.slab.Slab.reorder`)."""
        if list(rows) == list(range(len(rows))):
            return
        index = torch.tensor(list(rows))
        self.key_pos, self.n_cached = self.key_pos[index], self.n_cached[index]
        self.shift = None if self.shift is None else self.shift[index]
        if self.slab is not None:
            self.slab.reorder(rows)
        else:
            self.cache.batch_select_indices(send(index, self.device))

    def select(self, keep: Sequence[int]) -> None:
        """Keep only the sequences ``keep`` (indices into the current batch), then cut leading columns
        that are holes in every remaining sequence."""
        index = torch.tensor(list(keep))
        self.key_pos, self.n_cached = self.key_pos[index], self.n_cached[index]
        self.shift = None if self.shift is None else self.shift[index]
        valid = (self.key_pos >= 0).any(dim=0)
        lead = int(valid.long().argmax()) if bool(valid.any()) else 0
        if self.slab is not None:  # one copy for every layer
            self.slab.select(list(keep), lead)
            self.key_pos = self.key_pos[:, lead:]
            self.holes = bool((self.key_pos < 0).any())
            return
        self.cache.batch_select_indices(send(index, self.device))
        if lead > 0:
            for i, layer in enumerate(self.cache.layers):
                cut = max(0, lead - self.trim) if i in self.sliding else lead
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
            self.key_pos, self.trim = self.key_pos[:, lead:], max(0, self.trim - lead)
        self.holes = bool((self.key_pos < 0).any())
        self._trim_sliding()


def _left_padded_positions(pads: Sequence[int], width: int) -> torch.Tensor:
    """[B, width] (host) each column's position in rows left-padded by ``pads``, -1 for a pad."""
    key_pos = torch.stack([torch.arange(width) - pad for pad in pads])
    key_pos[key_pos < 0] = -1
    return key_pos


def _stacked_shifts(mine: DecoderRunner, theirs: DecoderRunner) -> tuple[torch.Tensor | None, bool]:
    """The position shifts of two batches stacked (a batch without any counts as shifted by 0):
    both of one model, whose positions are stacked or not alike."""
    if mine.shift is None and theirs.shift is None:
        return None, False
    axes = (mine.shift if mine.shift is not None else theirs.shift).shape[1]
    rows = [
        r.shift if r.shift is not None else torch.zeros(len(r.n_cached), axes, dtype=torch.long) for r in (mine, theirs)
    ]
    return torch.cat(rows), mine.stacked or theirs.stacked
