"""The output of a ``generate`` call, [B, S + T], assembled from its sequences as transformers
lays it out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sequences import SeqState


def assemble(seqs: Sequence[SeqState], prompt_len: int, stop_ends_seq: bool, pad_token_id) -> torch.Tensor:
    """The output [B, S + T] as transformers lays it out: T is the longest sequence up to its stop;
    shorter ones are padded after their stop; those that ran on past theirs are cut to T."""
    if stop_ends_seq:
        total = max(seq.length for seq in seqs)
    else:
        total = max(seq.stopped_at or seq.length for seq in seqs)
    first = seqs[0].ids
    if any(seq.length < total for seq in seqs) and pad_token_id is None:
        raise ValueError("sequences of the batch ended at different lengths: set generation_config.pad_token_id")
    out = first.new_full((len(seqs), total), 0 if pad_token_id is None else int(pad_token_id))
    for seq in sorted(seqs, key=lambda s: s.index):
        length = min(total, seq.length)
        out[seq.index, :length] = seq.ids[0, :length]
    return out
