"""Calibration: the forward passes a model's cost curves are timed over, and the curves they give.

:func:`model_cost_curve` is what ``Lookahead()`` prices a lone sequence's steps with, and
:func:`model_batch_costs` what it prices a batch's steps with: both run the model's own forward
passes (:func:`_calibration_step`) through ``lookahead.costs``, which times them once per model,
device, dtype and thread count and reads them back from disk after. :func:`measure_again` times
the stored ones again (``lookahead calibrate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .costs import (
    BATCH_CONTEXTS,
    BatchCosts,
    CostCurve,
    batch_curve,
    batch_shape,
    batch_sizes_to_measure,
    cost_curve,
    curve_key,
    forget,
    stored_curves,
)
from .layout import build_layout
from .runner import DecoderRunner
from .seq2seq_runner import Seq2SeqRunner
from .support import ModelTraits, check_model


def model_cost_curve(model, spec: ModelTraits | None = None) -> CostCurve:
    """The model's cost curve on its device, dtype and thread count, the one ``Lookahead()``
    prices its steps with: measured once, then read from disk (``lookahead.costs.cost_curve``)."""
    spec = spec or check_model(model)
    # without autograd, as generate runs (the bench and the server ask for the curve outside it):
    # with it, every timed pass recorded a graph that the calibration cache kept alive, so wide
    # passes were timed 1.3-2x dearer than decoding pays, and the process grew by GBs
    with torch.no_grad():
        return cost_curve(model, lambda: _calibration_step(model, spec))


def model_batch_costs(model, spec: ModelTraits, batch: int, rows: int) -> BatchCosts:
    """What the steps of a batch of up to ``batch`` sequences, of up to ``rows`` new tokens each,
    cost: measured at the batch sizes ``costs.batch_sizes_to_measure`` names and the cache
    lengths ``costs.BATCH_CONTEXTS`` names (shorter where the model's position table is), once,
    then read from disk (``lookahead.costs.batch_curve``)."""
    contexts = sorted({_context(spec, length) for length in BATCH_CONTEXTS})

    def measured(size: int, length: int) -> CostCurve:
        return batch_curve(model, size, length, rows, lambda: _calibration_step(model, spec, size, length))

    with torch.no_grad():  # as model_cost_curve
        single = model_cost_curve(model, spec)
        sizes = batch_sizes_to_measure(batch)
        by_batch = tuple((size, tuple((length, measured(size, length)) for length in contexts)) for size in sizes)
    return BatchCosts(single, by_batch)


@dataclass(frozen=True)
class Remeasured:
    """One curve measured again: what it prices (``batch`` sequences after ``context`` cached
    tokens; 1 and 0 for the lone sequence's curve), the stored one it replaced (None if there
    was none), and the new one."""

    batch: int
    context: int
    before: CostCurve | None
    after: CostCurve


def measure_again(model, spec: ModelTraits | None = None) -> list[Remeasured]:
    """Time the model's cost curves again on its device, dtype and thread count, replacing the
    stored ones: the lone sequence's, and each batch's curve stored on this machine, to the same
    token count (a curve timed while other work loaded the machine prices every later call until
    then; ``lookahead calibrate`` runs this)."""
    spec = spec or check_model(model)
    before = stored_curves(model)
    forget(list(before))
    own = curve_key(model)
    done = [Remeasured(1, 0, before.get(own), model_cost_curve(model, spec))]
    for key, old in sorted(before.items()):
        shape = batch_shape(key)
        if shape is None:  # the model's own curve, measured above
            continue
        batch, context = shape
        with torch.no_grad():
            new = batch_curve(model, batch, context, old.points[-1][0], _stepper(model, spec, batch, context))
        done.append(Remeasured(batch, context, old, new))
    return done


def _stepper(model, spec: ModelTraits, batch: int, length: int):
    """What ``batch_curve`` calls for its timed pass (bound now, not at the loop's last values)."""
    return lambda: _calibration_step(model, spec, batch, length)


def _context(spec: ModelTraits, length: int) -> int:
    """``length`` cached tokens, or fewer where the model's position table or RoPE threshold leaves
    less room (a dynamic RoPE keeps the frequencies of the longest pass it has seen)."""
    limit = spec.context_limit
    return length if limit is None else min(length, limit // 4)


def _calibration_step(model, spec: ModelTraits, batch: int = 1, length: int = 64):
    """A forward pass over k new tokens per sequence after a context of about ``length`` tokens
    (fewer where the position table is short), the cache restored after: what
    :func:`lookahead.costs.measure` times. In a batch (of a decoder-only model) every second
    context is a token shorter, so the cache holds holes and every step runs under a mask, as a
    batch's steps do once its sequences have advanced unevenly."""
    device = model.device
    context = _context(spec, length)
    if spec.encoder_decoder:
        encoder = model.get_encoder()(input_ids=torch.ones(batch, 32, dtype=torch.long, device=device))
        runner = Seq2SeqRunner(model, {"encoder_outputs": encoder})
        runner.prefill([[1] * context] * batch)
    else:
        runner = DecoderRunner(model, spec)
        runner.prefill([[1] * (context - b % 2) for b in range(batch)])

    def step(k: int) -> None:
        if spec.context_limit is not None and context + k >= spec.context_limit:
            k = spec.context_limit - context - 1  # the position table's end, or a RoPE threshold: time what fits
        runner.step(build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1), [[1] * k] * batch)
        if device.type != "cpu":  # the pass has finished before the clock is read
            torch.accelerator.synchronize(device)
        runner.cache.crop(-k)

    return step


__all__ = ["Remeasured", "measure_again", "model_batch_costs", "model_cost_curve"]
