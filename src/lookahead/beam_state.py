"""Beam search's bookkeeping, one depth at a time, exactly as ``generate(num_beams=k)`` keeps it.

:class:`BeamState` holds what transformers' beam search holds between forward passes (running
beams and their scores, the finished hypotheses, the early-stop flags) and :meth:`BeamState.advance`
moves it one token deeper from the running beams' next-token logits, with the same tensor
operations in the same order (log-softmax, logits processors, top ``2k`` over ``k x V``, stopping
criteria, the best ``k`` unfinished as the next running beams, the finished ones merged by their
length-penalised score). Same inputs, same floats: the outputs are bit for bit those of plain beam
search, whatever produced the logits.

It does not care where the logits come from, which is what lets :mod:`lookahead.beams` replay
several depths from one forward pass.
"""

from __future__ import annotations

import torch
from torch.nn import functional

FAR_BELOW = -1.0e9  # the score transformers gives a beam that must not be picked


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[b, index[b, i], ...]``: beams picked per batch item ([B, n] index into dim 1)."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


class BeamState:
    """Beam search over ``batch`` items of ``num_beams`` beams each (see the module docstring).

    ``input_ids`` [B * k, S]: the prompts, each repeated k times (as ``generate`` hands them over).
    """

    def __init__(self, input_ids: torch.Tensor, generation_config, eos_count: int, fill_value: int) -> None:
        k = generation_config.num_beams
        self.num_beams, self.batch = k, input_ids.shape[0] // k
        self.prompt_len = self.cur_len = input_ids.shape[1]
        self.max_length = generation_config.max_length
        self.length_penalty = generation_config.length_penalty
        self.early_stopping = generation_config.early_stopping
        self.do_sample = bool(generation_config.do_sample)
        self.beams_to_keep = max(2, 1 + eos_count) * k  # enough unfinished ones even if k pick an EOS
        self.top_mask = torch.arange(self.beams_to_keep) < k  # only the best k may finish
        b, device = self.batch, input_ids.device
        self.running = torch.full((b, k, self.max_length), fill_value, dtype=torch.int64, device=device)
        self.running[:, :, : self.cur_len] = input_ids.view(b, k, -1)
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros((b, k), dtype=torch.float, device=device)
        self.running_scores[:, 1:] = FAR_BELOW  # the k copies of a prompt: only the first one counts
        self.scores = torch.full((b, k), FAR_BELOW, dtype=torch.float, device=device)
        self.finished = torch.zeros((b, k), dtype=torch.bool, device=device)
        self.may_improve = torch.ones((b, 1), dtype=torch.bool, device=device)
        self.hits = torch.zeros((b, k), dtype=torch.bool, device=device)
        steps = self.max_length - self.cur_len
        self.running_indices = torch.full((b, k, steps), -1, dtype=torch.int32, device=device)
        self.indices = self.running_indices.clone()
        self.done = False

    def texts(self) -> torch.Tensor:
        """The running beams' tokens so far, [B * k, cur_len]."""
        return self.running[:, :, : self.cur_len].reshape(self.batch * self.num_beams, -1)

    def parents(self) -> list[int]:
        """For each running beam (flat, b * k + i), the flat index of the beam it grew from at the
        last :meth:`advance`."""
        return self.running_indices[:, :, self.cur_len - 1 - self.prompt_len].reshape(-1).tolist()

    def last_tokens(self) -> list[int]:
        return self.running[:, :, self.cur_len - 1].reshape(-1).tolist()

    def advance(
        self, logits: torch.Tensor, processors, stopping_criteria, record: dict | None = None, unknown=()
    ) -> bool:
        """One token deeper, from the running beams' next-token ``logits`` [B * k, V]. ``record``
        (``{"scores": [], "logits": []}``, where asked) collects what ``output_scores`` and
        ``output_logits`` return.

        ``unknown``: flat beams whose logits are not known (their rows hold anything). This depth
        can then be taken only if none of their continuations could be among the best ``2k`` (see
        :meth:`_prune`); otherwise nothing changes and it returns False."""
        logits = logits.to(copy=True, dtype=torch.float32)
        log_probs = processors(self.texts(), functional.log_softmax(logits, dim=-1))
        all_scores = None
        if record is not None:
            record["logits"].append(logits.clone())
            record["scores"].append(log_probs.clone())
            all_scores = tuple(record["scores"]) if record.get("output_scores") else None
        b, k = self.batch, self.num_beams
        log_probs = log_probs.view(b, k, -1) + self.running_scores[:, :, None]
        if unknown and not self._prune(log_probs, unknown):
            return False
        top_scores, top_seqs, top_indices = self._top_continuations(log_probs.reshape(b, -1))
        hits = stopping_criteria(top_seqs[:, :, : self.cur_len + 1].reshape(b * self.beams_to_keep, -1), all_scores)
        self.hits = hits.view(b, self.beams_to_keep)
        self._next_running(top_scores, top_seqs, top_indices)
        self._update_finished(top_scores, top_seqs, top_indices)
        self.cur_len += 1
        self._update_may_improve()
        self.done = not self._unfinished()
        return True

    def _prune(self, log_probs: torch.Tensor, unknown) -> bool:
        """Whether the beams ``unknown`` can be left out of this depth: each one's running score is
        below the ``2k``-th best continuation of the known beams of its item. Its continuations
        score its running score plus a log-probability <= 0 (the caller checks that the logits
        processors keep them so), so none of them is among the best ``2k``: leaving them out
        (-inf) changes no pick. ``log_probs`` [B, k, V] (scores added) is changed in place."""
        b, k = self.batch, self.num_beams
        rows = torch.zeros(b * k, dtype=torch.bool)
        rows[list(unknown)] = True
        rows = rows.view(b, k).to(log_probs.device)
        known = log_probs.masked_fill(rows[:, :, None], float("-inf")).reshape(b, -1)
        threshold = torch.topk(known, k=self.beams_to_keep).values[:, -1:]  # [B, 1]
        if bool(((self.running_scores >= threshold) & rows).any()):
            return False
        log_probs.masked_fill_(rows[:, :, None], float("-inf"))
        return True

    def _top_continuations(self, log_probs: torch.Tensor):
        """The best ``2k`` (beam, token) pairs per batch item -> their scores, sequences and beam indices."""
        if self.do_sample:  # k draws without replacement, then sorted by score (beam sampling)
            top = torch.multinomial(functional.softmax(log_probs, dim=-1), num_samples=self.beams_to_keep)
            top_scores, order = torch.gather(log_probs, 1, top).sort(dim=-1, descending=True)
            top = top.gather(dim=-1, index=order)
        else:
            top_scores, top = torch.topk(log_probs, k=self.beams_to_keep)
        vocab = log_probs.shape[-1] // self.num_beams
        beam = top // vocab
        top_indices = _gather(self.running_indices, beam)
        top_seqs = _gather(self.running, beam)
        top_seqs[:, :, self.cur_len] = top % vocab
        offset = torch.arange(self.batch, device=beam.device).view(-1, 1) * self.num_beams
        top_indices[:, :, self.cur_len - self.prompt_len] = beam + offset
        return top_scores, top_seqs, top_indices

    def _next_running(self, top_scores, top_seqs, top_indices) -> None:
        """The best k continuations that did not just stop run on."""
        scores = top_scores + self.hits.to(torch.float32) * FAR_BELOW
        best = torch.topk(scores, k=self.num_beams)[1]
        self.running = _gather(top_seqs, best)
        self.running_scores = _gather(scores, best)
        self.running_indices = _gather(top_indices, best)

    def _update_finished(self, top_scores, top_seqs, top_indices) -> None:
        """Continuations among the best k that just stopped join the finished hypotheses, by their
        length-penalised score, when they beat the worst kept one."""
        just_finished = self.hits & self.top_mask.to(self.hits.device)[None, :]
        scores = top_scores / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = torch.all(self.finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * FAR_BELOW
        scores += (~self.may_improve).to(torch.float32) * FAR_BELOW
        scores += (~just_finished) * FAR_BELOW
        merged_scores = torch.cat((self.scores, scores), dim=1)
        best = torch.topk(merged_scores, k=self.num_beams)[1]
        self.sequences = _gather(torch.cat((self.sequences, top_seqs), dim=1), best)
        self.scores = _gather(merged_scores, best)
        self.indices = _gather(torch.cat((self.indices, top_indices), dim=1), best)
        self.finished = _gather(torch.cat((self.finished, just_finished), dim=1), best)

    def _update_may_improve(self) -> None:
        """Whether the best running beam could still beat the worst finished hypothesis
        (transformers' early-stop heuristic, per ``early_stopping``)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_length - self.prompt_len
        else:
            length = self.cur_len - self.prompt_len
        best_possible = self.running_scores[:, :1] / (length**self.length_penalty)
        worst = torch.where(self.finished, torch.min(self.scores, dim=1, keepdim=True)[0], FAR_BELOW)
        self.may_improve = self.may_improve & torch.any(best_possible > worst, dim=-1, keepdim=True)

    def _unfinished(self) -> bool:
        improvable = torch.any(self.may_improve)
        open_beam = ~(torch.all(self.finished) & (self.early_stopping is True))
        continuable = ~torch.all(self.hits)
        return bool(improvable & open_beam & continuable)

    def result(self, num_return_sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequences [B * n, S'], sequences_scores [B * n], beam_indices [B * n, S' - S]): the best
        ``n`` hypotheses per item, cut to the longest one, as ``generate`` returns them."""
        n = num_return_sequences
        sequences = self.sequences[:, :n].reshape(self.batch * n, -1)
        scores = self.scores[:, :n].reshape(-1)
        indices = self.indices[:, :n].reshape(self.batch * n, -1)
        generated = int((indices + 1).bool().sum(dim=1).max())
        return sequences[:, : self.prompt_len + generated], scores, indices[:, :generated]
