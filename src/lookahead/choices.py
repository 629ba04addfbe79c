"""The model's greedy choices at a step's kept slots: the argmax over the vocabulary, read once.

Verification, the window's next level and the tuner's match lengths all read the model's raw
greedy choice at some of the step's kept slots. Where they are computed depends on the device:

* **An accelerator**: one argmax over every kept slot of every sequence ([B, K, V] -> [B, K]) and
  one read of the result, the step's one host-device synchronisation (:class:`StepChoices` with
  ``lazy=False``).
* **A CPU**: the argmax is the host's own work, proportional to slots times vocabulary (76 kept
  slots of 8 sequences with a 49k vocabulary are 30M logits, several milliseconds), and a read
  costs no synchronisation. So only the slots a step reads are computed (``lazy=True``): t and the
  window's last level up front, then the candidate slots depth by depth, each depth for the
  whole batch in one call, as long as the candidate still agrees with the model
  (:func:`fetch_matched`). Candidates that miss their first token cost nothing.

Both give exactly ``logits.argmax(-1)`` (the first index on ties), so the output never depends
on which is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .layout import StepLayout

_ARANGES: dict[tuple[torch.device, int], torch.Tensor] = {}


def greedy_choices(logits: torch.Tensor, rows: torch.Tensor | None = None, chunk: int = 512) -> torch.Tensor:
    """``logits.argmax(-1)`` ([..., V] -> [...] long), the same index on ties (the first) and with
    NaNs (the first NaN); with ``rows`` (a [M] index into the flattened leading dimensions of a
    contiguous [B, K, V]), only those rows: [M].

    On a CPU, torch's argmax over a long last dimension runs one element at a time, while ``amax``
    is vectorised; so the maximum of each chunk of ``chunk`` logits is taken first, then the first
    chunk holding the overall maximum is searched: about five times faster for a 49k vocabulary
    in bf16. Elsewhere torch's argmax is used as it is.
    """
    if rows is not None:
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or vocab <= 2 * chunk:
        return logits.argmax(dim=-1)
    whole = vocab // chunk
    if vocab % chunk == 0:  # the chunks are a view: no copy, no ragged tail
        chunks = logits.unflatten(-1, (whole, chunk))  # [..., whole, chunk]
        best = chunks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # [..., 1] first chunk holding the maximum
        inside = chunks.gather(-2, best[..., None].expand(*best.shape, chunk)).argmax(dim=-1)  # [..., 1]
        return inside.add_(best, alpha=chunk).squeeze(-1)
    maxima = logits[..., : whole * chunk].unflatten(-1, (whole, chunk)).amax(dim=-1)  # [..., V // chunk]
    maxima = torch.cat([maxima, logits[..., whole * chunk :].amax(dim=-1, keepdim=True)], dim=-1)
    start = maxima.argmax(dim=-1, keepdim=True) * chunk  # [..., 1] first chunk holding the maximum
    # that chunk's columns (the last chunk may be short: its tail repeats column V - 1, found later)
    key = (logits.device, chunk)
    if key not in _ARANGES:
        _ARANGES[key] = torch.arange(chunk, device=logits.device)
    columns = (start + _ARANGES[key]).clamp_max(vocab - 1)  # [..., chunk]
    return (start + logits.gather(-1, columns).argmax(dim=-1, keepdim=True)).squeeze(-1)


class StepChoices:
    """The raw greedy choice at each kept slot of one step: ``get(b, k)`` for sequence b and kept
    slot k (an index into ``layout.logit_slots``). ``lazy`` (default: on a CPU) computes them as
    they are asked for, batched by :meth:`fetch`; otherwise all at once, with one read."""

    def __init__(self, logits: torch.Tensor, lazy: bool | None = None) -> None:  # logits [B, K, V]
        self.logits = logits
        self.lazy = logits.device.type == "cpu" if lazy is None else lazy
        batch, kept = logits.shape[:2]
        if self.lazy:
            self._rows = [[-1] * kept for _ in range(batch)]  # [B][K], -1: not computed yet
            self.computed = 0  # slots whose argmax ran
        else:
            self._rows = greedy_choices(logits).tolist()  # [B][K]
            self.computed = batch * kept

    def get(self, b: int, k: int) -> int:
        choice = self._rows[b][k]
        if choice < 0:
            self.fetch([(b, k)])
            choice = self._rows[b][k]
        return choice

    def fetch_leading(self, count: int) -> None:
        """Compute the choices at kept slots 0..count-1 of every sequence (t and the window's last
        level lead the kept slots), in one call over a view of the logits."""
        if not self.lazy or count == 0:
            return
        for row, leading in zip(self._rows, greedy_choices(self.logits[:, :count]).tolist(), strict=True):
            row[:count] = leading
        self.computed += len(self._rows) * count

    def fetch(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Compute the choices at ``pairs`` ((sequence, kept slot)) not known yet, in one call."""
        if not self.lazy:
            return
        missing = list(dict.fromkeys(p for p in pairs if self._rows[p[0]][p[1]] < 0))
        if not missing:
            return
        kept = len(self._rows[0])
        rows = torch.tensor([b * kept + k for b, k in missing], device=self.logits.device)
        for (b, k), choice in zip(missing, greedy_choices(self.logits, rows).tolist(), strict=True):
            self._rows[b][k] = choice
        self.computed += len(missing)

    def at(self, b: int, kept: Sequence[int]) -> list[int]:
        """Sequence b's choices at the kept slots ``kept``, computing any not known yet."""
        row = self._rows[b]
        if any(row[k] < 0 for k in kept):
            self.fetch((b, k) for k in kept)
        return [row[k] for k in kept]

    def sequence(self, b: int) -> _SequenceChoices:
        """Sequence b's choices, indexed by kept slot."""
        return _SequenceChoices(self, b)


class _SequenceChoices:
    __slots__ = ("parent", "b")

    def __init__(self, parent: StepChoices, b: int) -> None:
        self.parent, self.b = parent, b

    def __getitem__(self, k: int) -> int:
        return self.parent.get(self.b, k)


def fetch_matched(choices: StepChoices, layout: StepLayout, candidates: Sequence[Sequence[Sequence[int]]]) -> None:
    """Compute, batch-wide and depth by depth, the choices that verification and match lengths
    read: t's and the last level's slots, then the slot after each token the model agrees with.
    ``candidates[b]``: sequence b's this step.

    The candidates still agreeing with the model at a depth all share the same prefix (the model's
    own choices), hence the same context: the first of them answers for all (verification follows
    it too), so each sequence needs one slot per depth.

    Example: t's choice is 5, candidates (5, 9, 2), (5, 6, 1) and (7, 3): depth 0 computes the
    slot of candidate 0's 5 (candidates 0 and 1 agree with 5, candidate 2 does not); if the model
    chose 9 there, depth 1 computes the slot of 9; the slots of 2, 6, 1, 7 and 3 are never computed.
    """
    if not choices.lazy:
        return
    index = layout.logit_index
    t, window = index[layout.t_slot], [index[s] for s in layout.last_level_slots]
    leading = {t, *window}
    assert leading == set(range(len(leading))), "t and the last level lead the kept slots"
    choices.fetch_leading(len(leading))
    # per sequence: (the model's choice before this depth, the candidates agreeing so far)
    state = {b: (choices.get(b, t), range(len(cands))) for b, cands in enumerate(candidates) if cands}
    depth = 0
    while state:
        agreeing = {}
        for b, (token, alive) in state.items():
            cands = candidates[b]
            alive = [c for c in alive if depth < len(cands[c]) and cands[c][depth] == token]
            if alive:  # the first one's slot answers for every one of them
                agreeing[b] = (index[layout.candidate_slots[alive[0]][depth]], alive)
        choices.fetch((b, k) for b, (k, _) in agreeing.items())
        state = {b: (choices.get(b, k), alive) for b, (k, alive) in agreeing.items()}
        depth += 1
