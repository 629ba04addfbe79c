"""``lookahead calibrate``: time a model's cost curves again on this machine, and show them.

The curves are timed once and kept (``lookahead.costs``); one timed while other work loaded the
machine prices every later call, so this command replaces them, and prints what changed.
"""

from __future__ import annotations

import time

from . import models
from .cli_common import device_for, quiet_transformers
from .quantization import SCHEMES

SHOWN = (2, 4, 8, 16)  # token counts whose T(k) / T(1) the table shows


def add_parser(sub) -> None:
    """``lookahead calibrate``'s options."""
    cal = sub.add_parser(
        "calibrate",
        help="time the model's cost curves again (its own and each batch's stored on this machine), replacing them",
    )
    cal.add_argument("--model", default=models.DEFAULT_MODEL, help="as for generate (default: %(default)s)")
    cal.add_argument("--dtype", default="bfloat16", choices=sorted(models.DTYPES), help="default: %(default)s")
    cal.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: auto: cuda when available)")
    cal.add_argument("--quantization", choices=sorted(SCHEMES), help="as for bench: that model's own curves")


def run(args) -> int:
    from .calibration import measure_again
    from .quantization import quantization_config

    quiet_transformers()
    device = device_for(args.device)
    if args.quantization is not None:  # its package is installed, before the load
        quantization_config(args.quantization, models.parse_dtype(args.dtype), device)
    model, _ = models.load(args.model, dtype=args.dtype, device=device, quantization=args.quantization)
    start = time.perf_counter()
    results = measure_again(model)
    seconds = time.perf_counter() - start
    print(f"cost curves of {args.model} ({args.dtype}, {model.device}), timed again in {seconds:.1f} s")
    print()
    print(table(results))
    return 0


def table(results) -> str:
    """Markdown: each curve's T(1) and T(k) / T(1), before and after."""
    head = " | ".join(f"T({k})/T(1)" for k in SHOWN)
    lines = [f"| curve | | T(1) ms | {head} |", "|---|---|---|" + "---|" * len(SHOWN)]
    for done in results:
        name = "one sequence" if done.batch == 1 else f"{done.batch} sequences, {done.context} cached tokens each"
        for label, curve in (("before", done.before), ("now", done.after)):
            if curve is None:
                lines.append(f"| {name} | {label} | (none stored) |" + " |" * len(SHOWN))
                continue
            ratios = " | ".join(f"{curve(k) / curve(1):.2f}" for k in SHOWN)
            lines.append(f"| {name} | {label} | {1000 * curve(1):.1f} | {ratios} |")
    return "\n".join(lines)
