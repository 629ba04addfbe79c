"""A/B: a batch's steps weighted towards the sequences furthest from their end, or not.

``generate`` returns when its last sequence ends, so ``Lookahead()`` weighs each sequence's
tokens by (tokens it may still emit / the most any may) ** ``Engine.laggard_power`` (4) when it
prices a batch's step (``lookahead.engine.Engine._weights``); power 0 counts every sequence's
tokens alike (tokens per second, as before). Both run against greedy on the same batches,
alternating batch by batch (``lookahead.bench.run_bench``), bf16 by default:

    .venv/bin/python benchmarks/ab_laggards.py --datasets humaneval mtbench --batch-size 4 8
"""

import argparse
import json

import transformers

from lookahead import Lookahead, bench, datasets, engine, models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--powers", type=float, nargs="+", default=[engine.Engine.laggard_power, 0.0])
    parser.add_argument("--out", help="write the summaries as JSON here")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)

    def method(power: float) -> bench.Method:
        lookahead = Lookahead()

        def kwargs() -> dict:  # made just before each of its calls: the power of that call
            engine.Engine.laggard_power = power
            return {"custom_generate": lookahead}

        return bench.Method(f"laggard power {power:g}", kwargs, lookahead)

    methods = [bench.methods_for()[0], *(method(power) for power in args.powers)]  # greedy first
    report = {}
    print("| dataset | batch | method | speedup (median) | tokens/s | tokens per step | wide steps | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        prompts = datasets.load(name, args.n)
        for size in args.batch_size:
            runs = bench.run_bench(model, tokenizer, prompts, methods, args.max_new_tokens, False, batch_size=size)
            rows = bench.summarize(runs)
            report[f"{name}, batch {size}"] = rows
            for row in rows:
                wide = "" if row["wide_share"] is None else f"{row['wide_share']:.0%}"
                print(
                    f"| {name} | {size} | {row['method']} | {row['speedup']:.3f}x | {row['throughput']:.1f} | "
                    f"{row['tokens_per_step']:.2f} | {wide} | {row['identical']:.0%} |",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summaries": report}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
