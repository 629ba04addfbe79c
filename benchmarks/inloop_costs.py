"""What each step size really costs inside Lookahead()'s loop, against the tuner's stored curve:
every forward pass of an auto-tuned run over a few prompts is timed, and the median seconds per
step size k give T(k)/T(1) as the loop meets it (real contexts, the mix of shapes, the allocator's
state), next to the ratio the tuner decides with. The tuner's curve comes from a short calibration
burst of same-shape passes (``lookahead.costs.measure``); this checks how well it carries over.

    .venv/bin/python benchmarks/inloop_costs.py --dataset mtbench --n 6
"""

import argparse
import statistics
import time

import transformers

from lookahead import Lookahead, costs, datasets, models
from lookahead.runner import DecoderRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    timings: list[tuple[int, float]] = []
    step = DecoderRunner.step

    def timed(self, layout, step_ids):
        start = time.perf_counter()
        out = step(self, layout, step_ids)  # synchronous on CPU; the logits are read right after
        timings.append((layout.length, time.perf_counter() - start))
        return out

    DecoderRunner.step = timed
    for i, prompt in enumerate(datasets.load(args.dataset, args.n)):
        inputs = datasets.encode(tokenizer, prompt)
        if i == 0:  # warm up, and measure (or read) the curve
            model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=Lookahead())
            timings.clear()
        model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate=Lookahead())
    curve = costs.cost_curve(model, make_step=None)  # the curve the runs above measured or read
    by_k: dict[int, list[float]] = {}
    for k, seconds in timings:
        by_k.setdefault(k, []).append(seconds)
    t1 = statistics.median(by_k[1])
    print(f"### {args.dataset}, {args.model} {args.dtype}, {args.n} prompts x {args.max_new_tokens} tokens")
    print("| k (rows) | steps | median ms | T(k)/T(1) in the loop | stored curve |")
    print("|---|---|---|---|---|")
    for k in sorted(by_k):
        median = statistics.median(by_k[k])
        print(f"| {k} | {len(by_k[k])} | {1000 * median:.1f} | {median / t1:.2f} | {curve.ratio(k):.2f} |")


if __name__ == "__main__":
    main()
