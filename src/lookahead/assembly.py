"""Assembly: what the engine runs on, built for a model and its settings.

Both adapters over ``lookahead.engine`` (``decoding``, the ``custom_generate`` callable, and
``service``, the server's engine thread) build their sequences and planners here:
:func:`settle` narrows the settings to what the model can take, :func:`new_sequence` makes a
sequence's state (its pool seeded from the prompt, its window and suffix index),
:func:`make_chooser` the per-step width chooser (``lookahead.tuning``, priced by the model's
measured costs, ``lookahead.calibration``) and :func:`make_drafter` the count drafter
(``lookahead.drafting``) where it applies.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .calibration import model_batch_costs, model_cost_curve
from .config import LookaheadConfig
from .costs import CostCurve
from .drafting import TreeDrafter
from .lookup import ContextIndex
from .pool import NGramPool
from .sequences import SeqState
from .support import ModelTraits
from .tuning import WidthChooser
from .window import JacobiWindow

logger = logging.getLogger(__name__)


def settle(cfg: LookaheadConfig, spec: ModelTraits, asked: dict | None = None) -> LookaheadConfig:
    """Models that take no position_ids (encoder-decoder decoders, ALiBi models) take linear
    steps only: no window, one candidate (see lookahead.support and lookahead.runner). ``asked``:
    the settings the user gave explicitly (warned about when narrowed)."""
    if not spec.linear or (cfg.window_size == 0 and cfg.max_candidates <= 1):
        return cfg
    asked = asked or {}
    if asked.get("window_size") or (asked.get("max_candidates") or 0) > 1:
        logger.warning(
            "this model takes no position_ids (encoder-decoder or ALiBi): lookahead runs with "
            "W=0 and G<=1, linear steps; asked for W=%s, G=%s",
            cfg.window_size,
            cfg.max_candidates,
        )
    return dataclasses.replace(cfg, window_size=0, max_candidates=min(1, cfg.max_candidates))


def new_sequence(
    cfg: LookaheadConfig,
    index: int,
    ids: torch.LongTensor,  # [1, S]: the caller's prompt, padding kept
    prompt: list[int],  # the prompt without padding
    max_length: int,
    *,
    source_ids: torch.LongTensor | None = None,  # [B, S_enc]: an encoder's input, pooled too
    full_window: bool = False,
    shared=None,
) -> SeqState:
    """A sequence with its pool (seeded from the prompt), window and suffix index."""
    pool = NGramPool(cfg.ngram_size, max(1, cfg.max_candidates))
    if cfg.seed_pool_from_prompt:
        pool.add_sequence(prompt)
        if source_ids is not None:
            pool.add_sequence(source_ids[index].tolist())
    window = JacobiWindow(cfg.window_size, cfg.ngram_size, prompt, full=full_window)
    context = ContextIndex() if cfg.context_lookup else None
    if context is not None:
        context.extend(prompt)
    return SeqState(
        index=index,
        prompt_ids=ids,
        committed=list(prompt),
        pool=pool,
        window=window,
        max_length=max_length,
        context=context,
        shared=shared,
    )


def make_chooser(
    model,
    cfg: LookaheadConfig,
    spec: ModelTraits,
    batch: int,
    curve: CostCurve | None = None,
    *,
    largest_batch: int | None = None,
) -> WidthChooser:
    """The width chooser for ``cfg``: adaptive ones price steps with ``curve``, or the model's
    cost curve (measured once, then read from disk), and the steps of a batch with its costs
    measured over batch shapes (``model_batch_costs``) up to ``largest_batch`` sequences (default
    ``batch``; a server passes the most it admits), unless the caller gave ``curve``."""
    measured = cfg.adaptive and curve is None
    if measured:
        curve = model_cost_curve(model, spec)
    chooser = WidthChooser(
        curve=curve if cfg.adaptive else None,
        max_candidates=cfg.max_candidates,
        ngram_size=cfg.ngram_size,
        window_size=cfg.window_size,
        batch=batch,
        enabled=cfg.adaptive,
    )
    largest = max(batch, largest_batch or 0)
    if measured and largest > 1 and (cfg.max_candidates > 0 or cfg.window_size > 0):
        chooser.batch_costs = model_batch_costs(model, spec, largest, chooser.rows(*chooser.widest))
    return chooser


def make_drafter(cfg: LookaheadConfig, spec: ModelTraits, batch: int, curve: CostCurve | None) -> TreeDrafter | None:
    """The count-based drafter (``lookahead.drafting``) where it applies: adaptive settings with
    ``count_drafting``, one sequence, token trees, a model taking position_ids; else None."""
    if not cfg.drafts or curve is None or batch != 1 or spec.linear:
        return None
    return TreeDrafter(curve, max_nodes=cfg.max_candidates * (cfg.max_emitted - 1), max_leaves=cfg.max_candidates)


__all__ = ["make_chooser", "make_drafter", "new_sequence", "settle"]
