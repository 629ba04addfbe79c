"""Forward passes and the KV cache for encoder-decoder models, their sequences aligned.

BART, Marian, T5 and their kin derive decoder positions from the cache length (absolute
embeddings, or T5's relative bias over slot distances), so a sequence's tokens must sit in
consecutive cache columns, all sequences alike. Steps use a linear layout (t and one candidate
chain, no window), and every sequence commits the same number of tokens, the smallest any
sequence accepted; the verified tokens a sequence could not commit are offered again as its first
candidate next step, where they are accepted at once (greedy). Decoder-only models take holes
instead (:mod:`lookahead.runner`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from .attention_switch import AS_THEY_ARE, CUDNN_OFF, leave_cudnn_out
from .host_inputs import id_rows, send
from .layout import StepLayout
from .media import MediaPrefill


class Seq2SeqRunner:
    """Encoder-decoder models: the decoder runs linear steps over aligned sequences."""

    aligned = True  # every sequence commits the same number of tokens per step
    grows_by_reorder = False  # the encoder's outputs come one per beam already

    def __init__(self, model, model_kwargs: dict) -> None:
        self.model, self.device = model, model.device  # read once (a property that walks the parameters)
        encoder_outputs = model_kwargs.get("encoder_outputs")
        if encoder_outputs is None:
            raise ValueError("no encoder_outputs were prepared: call model.generate, which runs the encoder once")
        self.encoder_hidden = encoder_outputs[0]  # [B, S_enc, D]
        self.encoder_mask = model_kwargs.get("attention_mask")  # [B, S_enc] or None
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.masked_attention = CUDNN_OFF if leave_cudnn_out() else AS_THEY_ARE  # see leave_cudnn_out

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, L] -> logits [B, L, V]
        return self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoder_hidden),
            attention_mask=self.encoder_mask,
            decoder_input_ids=ids,
            cache=self.cache,
            use_cache=True,
        ).logits

    def prefill(self, prompts: Sequence[Sequence[int]], media: MediaPrefill | None = None) -> torch.Tensor:
        """Run the decoder prompts (all the same length) -> last logits [B, V]. ``media`` is
        refused: encoder-decoder models take no images here."""
        if media is not None:
            raise ValueError("encoder-decoder models take no images")
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("encoder-decoder sequences need decoder prompts of one length (no decoder padding)")
        return self._forward(torch.tensor([list(p) for p in prompts], device=self.device))[:, -1]

    def step(self, layout: StepLayout, step_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """A linear step ([t, c_1, ..., c_k] per sequence) -> the used slots' logits [B, K, V]."""
        with self.masked_attention if layout.length > 1 else AS_THEY_ARE:
            logits = self._forward(send(id_rows(step_ids), self.device))
        return logits[:, send(layout.logit_slots, logits.device)]

    def commit(self, layout: StepLayout, picks: Sequence[tuple[int | None, int]]) -> None:
        """Every sequence keeps the same number of entries: t and the first accepted tokens. A sequence
        that kept fewer has just stopped inside the step and leaves the batch next (``select``)."""
        self.cache.crop(-(layout.length - max(k for _, k in picks)))

    @property
    def columns(self) -> int:
        """Decoder cache columns per sequence: what every query of a step attends over."""
        return self.cache.get_seq_length()

    def hand_back(self) -> EncoderDecoderCache:
        """The cache, for the caller of ``generate``."""
        return self.cache

    def reorder(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row ``rows[i]`` (rows may repeat: beam search's reorder)."""
        self.select(rows)

    def select(self, keep: Sequence[int]) -> None:
        index = torch.tensor(list(keep), device=self.encoder_hidden.device)
        self.cache.batch_select_indices(index)
        self.encoder_hidden = self.encoder_hidden[index]
        if self.encoder_mask is not None:
            self.encoder_mask = self.encoder_mask[index]
