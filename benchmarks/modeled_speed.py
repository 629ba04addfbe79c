"""Modeled speed, free of timing noise: Lookahead() variants run in fp32 (so every variant emits the
same text, plain greedy's), while the tuner decides with the stored bf16 cost curve and every step is
priced with it: modeled speedup = new tokens / sum over steps of T(k)/T(1). It is what the bf16 run
would do on the same text; the bf16 bench then checks it against the clock. Needs the bf16 curve in
$LOOKAHEAD_CACHE/cost-curves.json (any bf16 run of Lookahead() on the model stores it).

    .venv/bin/python benchmarks/modeled_speed.py --n 10 --off token_tree

``--true-excess F`` prices the steps with a curve whose extra cost over a plain step is F times the
stored one's (T'(k) = T(1) + F (T(k) - T(1))) while the tuner still decides with the stored curve:
what a miscalibrated curve costs; add ``--decide-true`` to let the tuner decide with the true one.
"""

import argparse
import statistics
import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).parent))
import policy_share  # noqa: E402  (the stored curve)

from lookahead import Lookahead, calibration, costs, datasets, models  # noqa: E402
from lookahead.runner import DecoderRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--off", nargs="*", default=[], help="Lookahead flags to turn off, one variant each")
    parser.add_argument("--true-excess", type=float, default=1.0, help="price steps with this much extra cost")
    parser.add_argument("--decide-true", action="store_true", help="the tuner decides with the priced curve")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype="float32")
    curve = policy_share.stored_curve(args.model)
    t1 = curve(1)
    true = costs.CostCurve(tuple((k, t1 + (s - t1) * args.true_excess) for k, s in curve.points))
    decide = true if args.decide_true else curve
    calibration.cost_curve = lambda model, make_step: decide  # as the bf16 run would (or with the priced curve)
    cost = [0.0]
    step = DecoderRunner.step

    def priced(self, layout, step_ids):
        cost[0] += true.ratio(layout.length, len(step_ids))
        return step(self, layout, step_ids)

    DecoderRunner.step = priced
    variants = {"auto": {}, **{f"auto, no {flag}": {flag: False} for flag in args.off}}
    print("stored bf16 curve: T(k)/T(1) = " + ", ".join(f"{k}: {curve.ratio(k):.2f}" for k in (2, 4, 8, 16)))
    print("\n| dataset | variant | modeled speedup (median) | (mean) | tokens/step | wide steps |")
    print("|---|---|---|---|---|---|")
    for name in args.datasets:
        prompts = datasets.load(name, args.n)
        results = {v: [] for v in variants}
        for prompt in prompts:
            inputs = datasets.encode(tokenizer, prompt)
            outputs = []
            for variant, flags in variants.items():
                lookahead = Lookahead(**flags)
                cost[0] = 0.0
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     custom_generate=lookahead)  # fmt: skip
                s = lookahead.last_stats
                results[variant].append((s.new_tokens - 1, cost[0], s.tokens_per_step, s.wide_steps / s.steps))
                outputs.append(out.tolist())
            assert all(o == outputs[0] for o in outputs), "variants must emit the same text"
        for variant, rows in results.items():
            ratios = [tokens / c for tokens, c, _, _ in rows]
            per_step, wide = statistics.mean(r[2] for r in rows), statistics.mean(r[3] for r in rows)
            print(f"| {name} | {variant} | {statistics.median(ratios):.3f}x | {statistics.mean(ratios):.3f}x | "
                  f"{per_step:.2f} | {wide:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
