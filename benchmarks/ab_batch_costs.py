"""Does a batch run faster when its steps are priced by measured batch costs, or by the single curve?

``Lookahead()`` prices the steps of a batch with costs measured over batch sizes and cache lengths
(``lookahead.costs.BatchCosts``); ``Lookahead(cost_curve=<the model's single curve>)`` prices
them as before those existed, T(B * k) / T(B). Both run against greedy on the same batches,
alternating batch by batch (``lookahead.bench.run_bench``), bf16 by default. Prints a row per
dataset, batch size and method (speedup, tokens/s, tokens per step, wide steps, identical to
greedy); ``--out`` keeps the summaries as JSON.

    .venv/bin/python benchmarks/ab_batch_costs.py --batch-size 4 8 16           # docs/batches.md
    .venv/bin/python benchmarks/ab_batch_costs.py --n 2 --max-new-tokens 8 --datasets humaneval \\
        --batch-size 2                                                          # smallest: seconds
"""

import argparse
import json

import transformers

from lookahead import Lookahead, bench, datasets, models
from lookahead.calibration import model_cost_curve
from lookahead.report import summarize


def main() -> None:
    args = batch_parser(__doc__).parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    measured, single = Lookahead(), Lookahead(cost_curve=model_cost_curve(model))
    methods = [
        bench.methods_for()[0],  # greedy
        bench.Method("batch costs", lambda: {"custom_generate": measured}, measured),
        bench.Method("single curve", lambda: {"custom_generate": single}, single),
    ]
    compare_batches(model, tokenizer, methods, args)


def batch_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a batched A/B: prompts, tokens, model, dtype, datasets, batch sizes, output."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", help="write the summaries as JSON here")
    return parser


def compare_batches(model, tokenizer, methods: list, args) -> None:
    """Run ``methods`` (greedy first) on batches of each of ``args.batch_size`` over the prompts of
    ``args.datasets``, alternating batch by batch, print a row per method, keep them in ``args.out``."""
    report = {}
    print("| dataset | batch | method | speedup (median) | tokens/s | tokens per step | wide steps | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        prompts = datasets.load(name, args.n)
        for size in args.batch_size:
            runs = bench.run_bench(model, tokenizer, prompts, methods, args.max_new_tokens, False, batch_size=size)
            rows = summarize(runs)
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
