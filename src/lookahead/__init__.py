"""lookahead: lossless lookahead decoding for Hugging Face transformers models.

Glossary (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"):

* **t**: the last accepted token; each step starts from it.
* **W, window size**: Jacobi columns of the lookahead branch.
* **N, n-gram size**: tokens per pooled n-gram; the window has N-1 levels; a step emits <= N tokens.
* **G, candidates**: the most pooled n-grams verified in one step.
* **lookahead branch**: the W x (N-1) window of Jacobi guesses, refined one level per step; each
  column yields a fresh n-gram.
* **verification branch**: up to G candidate n-grams that start with t, checked against the
  model's own predictions in the same forward pass.
* **pool**: the n-grams collected from the window, the prompt and the output, keyed by first token.
* **accepted tokens**: candidate tokens equal to the model's own choice; **bonus token**: the
  model's choice after the last accepted token, always emitted.

Usage::

    from lookahead import Lookahead
    out = model.generate(**inputs, custom_generate=Lookahead(), max_new_tokens=128)
"""

from __future__ import annotations

import importlib

__all__ = ["Lookahead", "LookaheadConfig", "LookaheadStats", "UnsupportedModelError"]
__version__ = "0.1.0"

# The names above are imported on first use, not with the package: ``lookahead.vllm`` runs inside
# vLLM's environment, whose transformers is older than the decoding loop asks for, and imports
# only the drafter (``lookahead.proposer``), which must not drag the decoding loop in with it.
_LAZY = {
    "Lookahead": "decoding",
    "LookaheadConfig": "config",
    "LookaheadStats": "config",
    "UnsupportedModelError": "support",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
