"""Settings and statistics of lookahead decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Defaults by device type. CPU: measured with benchmarks/pick_default.py on 2 cores, where a
# forward pass over 2 tokens already costs ~1.3x one token (fp32; ~2x at 4 tokens in bf16): the
# window's rows never paid for themselves, so the CPU default verifies pooled n-grams only
# (prompt + output). CUDA: the paper's setting for 7B models on an A100, not measured here.
_DEFAULTS = {
    "cpu": (0, 4, 4),
    "cuda": (15, 5, 15),
}
_FALLBACK = (7, 4, 7)


@dataclass(frozen=True)
class LookaheadConfig:
    """Window size W, n-gram size N and the most candidates verified per step G.

    * ``window_size`` (W >= 0): Jacobi columns of the lookahead branch; 0 turns the branch off,
      leaving only candidates from the prompt and the text generated so far.
    * ``ngram_size`` (N >= 2): length of the pooled n-grams and the window's; a step emits at
      most N tokens, unless it was count-drafted (``draft_length``).
    * ``max_candidates`` (G >= 0): candidates verified per step, and n-grams kept per key in
      the pool; 0 turns the verification branch off.
    * ``seed_pool_from_prompt``: also pool the prompt's own n-grams (helps code, RAG, summaries).
    * ``pool_from_output``: also pool the n-grams of the text generated so far.
    * ``context_lookup``: propose first what followed earlier occurrences of the context's
      longest suffix (see ``lookahead.lookup``).
    * ``token_tree``: candidates that share a prefix share its rows (see ``lookahead.layout``);
      a batch of one only, since rows of a batch share one layout.
    * ``adaptive``: choose, step by step, how many candidates of how many tokens to verify (or a
      plain one-token step) from the model's measured cost curve and the acceptance seen so far
      (see ``lookahead.tuning``); W, N and G are then upper bounds. Output is unchanged.
    * ``count_drafting``: with ``adaptive`` and one sequence, draft each step's token tree node
      by node from how often each continuation followed the context before, as long as the
      expected tokens pay for the slots, the window's rows included when W > 0 (see
      ``lookahead.drafting``); otherwise the per-step setting above is chosen for the whole step.
    * ``draft_length`` (>= 1): the most tokens a count-drafted candidate may have. It is not tied
      to N: N sizes the pool's and the window's n-grams (and a batch's candidates), while a drafted
      candidate follows an earlier occurrence of the context for as long as the evidence pays for
      its slots, so code that repeats a long span gets it verified in one step. A step then emits
      up to ``draft_length + 1`` tokens (:attr:`max_emitted`).
    """

    window_size: int
    ngram_size: int
    max_candidates: int
    seed_pool_from_prompt: bool = True
    pool_from_output: bool = True
    context_lookup: bool = True
    token_tree: bool = True
    adaptive: bool = False
    count_drafting: bool = True
    draft_length: int = 7

    def __post_init__(self) -> None:
        for name, value, low in (
            ("window_size (W)", self.window_size, 0),
            ("ngram_size (N)", self.ngram_size, 2),
            ("max_candidates (G)", self.max_candidates, 0),
            ("draft_length", self.draft_length, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    @property
    def drafts(self) -> bool:
        """Whether a sequence running alone may be count-drafted (``lookahead.drafting``): adaptive
        settings with count drafting and token trees, some candidates; with or without a window.
        (The model must take position_ids too, and the batch must be one sequence: see
        ``assembly.make_drafter``.)"""
        return self.adaptive and self.count_drafting and self.token_tree and self.max_candidates > 0

    @property
    def max_emitted(self) -> int:
        """The most tokens one step emits for a sequence: N, or a count-drafted candidate and its
        bonus token."""
        return max(self.ngram_size, self.draft_length + 1) if self.drafts else self.ngram_size

    @classmethod
    def default_for(cls, device: torch.device | str, **overrides) -> LookaheadConfig:
        """A good default for ``device``; explicit values in ``overrides`` win (None = default)."""
        w, n, g = _DEFAULTS.get(torch.device(device).type, _FALLBACK)
        chosen = {"window_size": w, "ngram_size": n, "max_candidates": g}
        chosen.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**chosen)


@dataclass
class LookaheadStats:
    """What one generate call did. Read it from ``Lookahead.last_stats`` after the call.

    ``steps`` counts the forward passes that produced tokens, the prompt's prefill included (so
    plain decoding of one sequence would take ``new_tokens`` steps); ``sequence_steps`` counts
    each pass once per sequence it carried. ``accepted_hist[k]`` is the number of sequence steps
    whose verification
    produced k + 1 tokens (k accepted candidate tokens plus the bonus token); a stop (EOS, stop
    string, max length) inside a step drops the tokens after it, counted in
    ``truncated_tokens``.
    """

    config: LookaheadConfig
    batch_size: int = 1
    prompt_tokens: int = 0  # all sequences, without padding
    new_tokens: int = 0  # all sequences, without padding
    steps: int = 0  # forward passes
    sequence_steps: int = 0  # forward passes times the sequences active in each
    accepted_hist: list[int] = field(default_factory=list)
    truncated_tokens: int = 0  # verified tokens dropped because a stop came before them
    wide_steps: int = 0  # steps that carried the window or candidates (the rest: t alone)
    settings: dict = field(default_factory=dict)  # steps per chosen setting, e.g. {"G=1,N=3": 40, "plain": 9}
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per sequence and step (the compression ratio over plain decoding)."""
        return self.new_tokens / max(1, self.sequence_steps or self.steps)

    @property
    def mean_accepted(self) -> float:
        """Mean candidate tokens accepted per step (tokens per step minus the bonus token)."""
        total = sum(self.accepted_hist)
        return sum(k * c for k, c in enumerate(self.accepted_hist)) / max(1, total)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "window_size": self.config.window_size,
            "ngram_size": self.config.ngram_size,
            "max_candidates": self.config.max_candidates,
            "batch_size": self.batch_size,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "sequence_steps": self.sequence_steps,
            "tokens_per_step": self.tokens_per_step,
            "mean_accepted": self.mean_accepted,
            "accepted_hist": list(self.accepted_hist),
            "truncated_tokens": self.truncated_tokens,
            "wide_steps": self.wide_steps,
            "settings": dict(self.settings),
            "adaptive": self.config.adaptive,
            "count_drafting": self.config.count_drafting,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }
