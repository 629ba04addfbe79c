"""Emission: appending a step's verified tokens to each sequence as plain decoding would, through
its stopping criteria, the streamer and the scores asked for; and, for aligned runners, cutting
every sequence's tokens to the batch's shortest verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .sequences import SeqState
from .step import Scorer
from .stopping import StopCheck
from .verify import Verdict


def align(verdicts: Sequence[Verdict], seqs: Sequence[SeqState]) -> list[Verdict]:
    """Aligned runners: every sequence emits as many tokens as the shortest verdict; the verified
    tokens a sequence cannot emit now become its first candidate next step (``seq.carry``)."""
    width = min(len(v.emitted) for v in verdicts)
    out = []
    for verdict, seq in zip(verdicts, seqs, strict=True):
        seq.carry = verdict.emitted[width:]
        out.append(dataclasses.replace(verdict, emitted=verdict.emitted[:width], path=verdict.path[: width - 1]))
    return out


class Emitter:
    """Appends tokens to sequences as plain decoding would: stopping criteria, streamer, scores."""

    def __init__(self, streamer=None, want_scores: bool = False, want_logits: bool = False, stop_ends_seq: bool = True):
        self.streamer = streamer
        self.want_scores, self.want_logits = want_scores, want_logits
        # with an EOS criterion (or one sequence), a stopped sequence ends; without, transformers
        # keeps decoding it, unpadded, until every sequence has stopped
        self.stop_ends_seq = stop_ends_seq
        self.scores: tuple = ()
        self.logits: tuple = ()

    def emit(self, seq: SeqState, tokens: Sequence[int], slots: Sequence[int], scorer: Scorer) -> int:
        """Append tokens one by one until the sequence ends; returns how many were appended."""
        check = self._check(seq)
        for count, (token, slot) in enumerate(zip(tokens, slots, strict=True), start=1):
            if self.want_scores:
                self.scores += (scorer.processed(slot)[None],)
            if self.want_logits:
                self.logits += (scorer.raw(slot)[None],)
            seq.committed.append(token)
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
            if (
                seq.stopped_at is None
                and check is not None
                and check(seq, token, self.scores if self.want_scores else None)
            ):
                seq.stopped_at = seq.length
                if self.stop_ends_seq:
                    return count
        return len(tokens)

    @staticmethod
    def _check(seq: SeqState) -> StopCheck | None:
        """The sequence's stop check, built once per criteria list and kept on the sequence (so it
        goes with it: a server's emitter outlives every request)."""
        criteria = seq.criteria
        if criteria is None or len(criteria) == 0:
            return None
        if seq.stop_check is None or seq.stop_check.criteria is not criteria:
            seq.stop_check = StopCheck(criteria)
        return seq.stop_check
