"""What does a step of k tokens per sequence cost a batch, against its plain step, by cache length?

Times ``DecoderRunner.step`` directly (no decoding loop): B left-padded contexts of about C
tokens (every second one a token shorter, so the cache holds holes and every step runs under a
mask, as a batch's steps do), k = 1, 2, 4, 7 new tokens per sequence (``--counts``), the cache
cropped back after each pass; rounds alternate up and down in k, and each ratio is the median
over k = 1's. Prints a row per batch size and cache length: the plain step's milliseconds and
T_B(k) / T_B(1) for each k, with the single-sequence curve's estimate, T(B * k) / T(B), beside it.

    .venv/bin/python benchmarks/batch_step_cost.py                              # docs/batches.md
    .venv/bin/python benchmarks/batch_step_cost.py --dtype float32 --batch 1 --context 64 --counts 1 2 3 4 5 6 7 8
    .venv/bin/python benchmarks/batch_step_cost.py --batch 2 --context 16 --rounds 1 --counts 1 2   # smallest
"""

import argparse
import statistics
import time

import torch
import transformers

from lookahead import models
from lookahead.calibration import model_cost_curve
from lookahead.layout import build_layout
from lookahead.runner import DecoderRunner
from lookahead.support import check_model

COUNTS = (1, 2, 4, 7)


def ratios(
    model, spec, batch: int, context: int, rounds: int, counts: tuple[int, ...] = COUNTS
) -> tuple[float, dict[int, float]]:
    runner = DecoderRunner(model, spec)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(context - i % 2)] for i in range(batch)]
    runner.prefill(prompts)

    def step(k: int) -> None:
        runner.step(build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1), [[1] * k] * batch)
        runner.cache.crop(-k)

    for k in counts:  # warm-up
        step(k)
    seconds: dict[int, list[float]] = {k: [] for k in counts}
    for round_ in range(rounds):
        for k in counts if round_ % 2 == 0 else counts[::-1]:
            start = time.perf_counter()
            step(k)
            seconds[k].append(time.perf_counter() - start)
    plain = statistics.median(seconds[1])
    return plain, {k: statistics.median(s) / plain for k, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS), help="k: new tokens per sequence")
    args = parser.parse_args()
    counts = tuple(sorted({1, *args.counts}))
    transformers.utils.logging.set_verbosity_error()
    model, _ = models.load(args.model, dtype=args.dtype)
    spec = check_model(model)
    curve = model_cost_curve(model, spec)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads; T_B(k) / T_B(1), and T(B*k) / T(B)")
    print("| batch | cached tokens | plain step (ms) | " + " | ".join(f"k = {k}" for k in counts[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(counts) - 1))
    with torch.no_grad():
        for batch in args.batch:
            for context in args.context:
                plain, measured = ratios(model, spec, batch, context, args.rounds, counts)
                cells = [f"{measured[k]:.2f} ({curve.ratio(k, batch):.2f})" for k in counts[1:]]
                print(f"| {batch} | {context} | {plain * 1000:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
