"""What a server request runs with: the sequence :class:`lookahead.service.Service` builds for it
before it joins the batch.

A request's own W/N/G caps within the server's, its sampling (temperature, top-k, top-p, a seed),
its stopping criteria (the model's EOS ids), and the logits processors that the model's own
``generation_config`` gives every ``model.generate`` call, in transformers' order, so that a greedy
request's text is the one ``generate`` gives. What the server does not build is named once, at
start (:func:`not_applied`).
"""

from __future__ import annotations

import dataclasses
import random

import torch
from transformers import (
    EosTokenCriteria,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .assembly import new_sequence
from .config import LookaheadConfig
from .pool import SharedPool
from .sequences import SeqState


class SequenceSetup:
    """Builds each request's :class:`SeqState` for ``model`` under the server's ``cfg``."""

    def __init__(self, model, cfg: LookaheadConfig) -> None:
        self.model, self.cfg = model, cfg
        eos = model.generation_config.eos_token_id
        self.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def sequence(self, request, pool: SharedPool | None) -> SeqState:
        """``request`` (a :class:`lookahead.service.Request`) as a sequence drafting from ``pool``.
        Raises what its processors raise for settings they refuse."""
        w, n, g = request.settings(self.cfg)
        cfg = dataclasses.replace(self.cfg, window_size=w)
        ids = torch.tensor([request.prompt_ids], device=self.model.device)
        max_length = len(request.prompt_ids) + request.max_tokens
        seq = new_sequence(cfg, 0, ids, request.prompt_ids, max_length, full_window=True, shared=pool)
        # a request's own N caps its drafts too; without one, drafts run to the server's draft length
        own_n = request.lookahead[1] if request.lookahead else None
        seq.max_candidates, seq.ngram_size = g, (None if own_n is None else n)
        seq.criteria = StoppingCriteriaList([EosTokenCriteria(self.eos)]) if self.eos else None
        processors = self.model_processors(len(request.prompt_ids))
        if request.temperature > 0:
            processors.append(TemperatureLogitsWarper(float(request.temperature)))
            if request.top_k:
                processors.append(TopKLogitsWarper(request.top_k))
            if request.top_p < 1.0:
                processors.append(TopPLogitsWarper(float(request.top_p)))
            seq.seed = request.seed if request.seed is not None else random.getrandbits(63)
        seq.processors = LogitsProcessorList(processors) if processors else None
        return seq

    def model_processors(self, prompt_length: int) -> list:
        """The logits processors that the model's own generation_config gives every
        ``model.generate`` call (a model may ship a repetition_penalty), in transformers' order;
        those this server does not build are named at start (:func:`not_applied`)."""
        config, eos = self.model.generation_config, torch.tensor(self.eos, dtype=torch.long)
        out = []
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
        if config.no_repeat_ngram_size:
            out.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
        if config.bad_words_ids is not None:
            out.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
        if config.min_length and self.eos:
            out.append(MinLengthLogitsProcessor(config.min_length, eos))
        if config.min_new_tokens and self.eos:
            out.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos))
        if config.suppress_tokens is not None:
            out.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
        return out


# generation_config fields that change what plain generate emits, beyond those model_processors builds
_OTHER_OUTPUT_FIELDS = ("sequence_bias", "forced_bos_token_id", "forced_eos_token_id",
                        "exponential_decay_length_penalty", "begin_suppress_tokens", "watermarking_config")  # fmt: skip


def not_applied(config) -> list[str]:
    """The fields of a ``generation_config`` that change ``model.generate``'s text and that this
    server does not apply."""
    return [name for name in _OTHER_OUTPUT_FIELDS if getattr(config, name, None) is not None]
