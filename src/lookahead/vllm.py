"""Lookahead's drafter as vLLM's speculative proposer: the edge between vLLM and
:class:`lookahead.proposer.ChainProposer`.

Use it as vLLM's ``custom_class`` method; options go through ``additional_config`` (the
speculative config refuses keys it does not know)::

    llm = LLM(
        model=path,
        speculative_config={
            "method": "custom_class",
            "model": "lookahead.vllm.LookaheadProposer",
            "num_speculative_tokens": 16,
        },
        additional_config={"lookahead": {"shared_pool": True}},
    )

This module imports no vLLM and nothing of this package that needs more than vLLM's own
environment has (its transformers is older than the one the rest of the library asks for):
``lookahead.proposer`` and the drafter under it. See docs/vllm.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .proposer import ChainProposer, ProposerOptions

logger = logging.getLogger(__name__)

OPTIONS_KEY = "lookahead"  # this proposer's options in vLLM's additional_config


class LookaheadProposer:
    """vLLM's proposer interface (``method="custom_class"``): built with the engine's config,
    ``load_model`` (nothing to load), and ``propose`` after every step, which never raises."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        extra = getattr(vllm_config, "additional_config", None) or {}
        given = extra.get(OPTIONS_KEY, {}) if isinstance(extra, dict) else {}
        options = ProposerOptions.from_mapping(given)
        max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
        if max_num_seqs and options.max_requests < max_num_seqs:
            raise ValueError(
                f"lookahead option 'max_requests' ({options.max_requests}) must be at least the engine's "
                f"max_num_seqs ({max_num_seqs}): every request in the batch keeps its state"
            )
        self.core = ChainProposer(spec.num_speculative_tokens, vllm_config.model_config.max_model_len, options)
        self._failed = 0

    def load_model(self, *args, **kwargs) -> None:
        """The CPU runner calls this with the target model; the drafter has no model of its own."""

    @property
    def errors(self) -> int:
        """Calls or rows whose drafting failed (each proposed [] instead)."""
        return self.core.errors + self._failed

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec,  # np.ndarray [rows]: tokens of each row, sampled ones included
        token_ids_cpu,  # np.ndarray [max rows, max_model_len]: row i's text in [i, :num_tokens_no_spec[i]]
        slot_mappings=None,  # unused: the drafter runs no model
    ) -> list[list[int]]:
        """One draft per batch row: a chain of at most ``num_speculative_tokens`` tokens, or []."""
        rows = len(sampled_token_ids)
        try:
            texts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in range(rows)]
            sampled = [[int(t) for t in emitted if t >= 0] for emitted in sampled_token_ids]
            return self.core.propose(sampled, texts)
        except Exception:  # never into vLLM's step: no drafts this step
            self._failed += 1
            if self._failed == 1:
                logger.exception("lookahead's proposer failed; this step drafts nothing (later failures only counted)")
            return [[] for _ in range(rows)]
