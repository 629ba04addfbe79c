"""One vLLM proposer that is several, switched between requests: what ``vllm_paired.py`` runs in
one engine, so that the proposers it compares take turns on the same engine, minute by minute.

Not a tool itself. The engine must run in the driver's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and ``distributed_executor_backend="uni"``), which sets ``MODE`` and ``REQUEST`` before each request
and runs one request at a time. Modes: ``plain`` (no draft), ``ngram k=K`` (vLLM's ``ngram``
matcher with its defaults, a 5-token match, K tokens), ``suffix`` (arctic-inference's cache driven
as vLLM 0.32's suffix proposer drives it, with vLLM's defaults), ``lookahead``
(``lookahead.vllm.LookaheadProposer``, at most ``LOOKAHEAD_K`` tokens; ``lookahead k=K``, at most K,
a proposer of its own). The engine's
``num_speculative_tokens`` must be at least the largest of them (suffix: 24).
"""

from __future__ import annotations

import time

import numpy as np

from lookahead.proposer import ChainProposer
from lookahead.vllm import LookaheadProposer

MODE = "plain"
STEPS: list[tuple[str, int, float]] = []  # (mode, draft tokens verified, seconds) of each timed step
REQUEST = 0  # the request now running (one at a time), for suffix decoding's per-request tree
LOOKAHEAD_K = 16
SUFFIX = {"depth": 24, "factor": 1.0, "min_prob": 0.1, "cached": 10000}  # vLLM 0.32's defaults


class Switch:
    def __init__(self, vllm_config) -> None:
        self.config, self.max_model_len = vllm_config, vllm_config.model_config.max_model_len
        self.lookaheads: dict[int, LookaheadProposer] = {}
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self.ngram = _find_longest_matched_ngram_and_propose_tokens
        self.suffix = None
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache

            self.suffix = SuffixDecodingCache(max_tree_depth=SUFFIX["depth"], max_cached_requests=SUFFIX["cached"])
        except ImportError:
            pass
        self._suffix_request = None
        self._last: tuple[str, int, float] | None = None  # mode, draft tokens and end of the last call

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """The drafts of the mode now set; times the engine's step since the last call (one row)."""
        now = time.perf_counter()
        if self._last is not None and self._last[0] == MODE and all(sampled_token_ids):
            STEPS.append((MODE, self._last[1], now - self._last[2]))
        drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)
        self._last = (MODE, sum(map(len, drafts)), time.perf_counter())
        return drafts

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings):
        if MODE.startswith("lookahead"):
            k = int(MODE.split("=")[1]) if "=" in MODE else LOOKAHEAD_K
            return self._lookahead(k).propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or MODE == "plain":
                drafts.append([])
            elif MODE.startswith("ngram k="):
                k = min(int(MODE.split("=")[1]), self.max_model_len - n - 1)
                drafts.append([int(t) for t in self.ngram(token_ids_cpu[i, :n], 5, 5, self.max_model_len, k)])
            elif MODE == "suffix":
                drafts.append(self._suffix(sampled, token_ids_cpu[i, :n], n))
            else:
                raise ValueError(f"unknown mode {MODE!r}")
        return drafts

    def _lookahead(self, k: int) -> LookaheadProposer:
        if k not in self.lookaheads:
            proposer = LookaheadProposer(self.config)
            proposer.core = ChainProposer(k, self.max_model_len, proposer.core.options)
            self.lookaheads[k] = proposer
        return self.lookaheads[k]

    def _suffix(self, sampled, text: np.ndarray, n: int) -> list[int]:
        if self._suffix_request != REQUEST:
            if self._suffix_request is not None:
                self.suffix.stop_request(self._suffix_request)
            self._suffix_request = REQUEST
            self.suffix.start_request(REQUEST, text[: n - len(sampled)])
        self.suffix.add_active_response(REQUEST, list(sampled))
        draft = self.suffix.speculate(
            REQUEST,
            text[max(0, n - SUFFIX["depth"]) :],
            max_spec_tokens=min(SUFFIX["depth"], self.max_model_len - n - 1),
            max_spec_factor=SUFFIX["factor"],
            min_token_prob=SUFFIX["min_prob"],
        )
        return list(draft.token_ids)
