"""A/B: does the longest-suffix lookup pay? Lookahead() with and without it, against greedy and
prompt lookup, alternating prompt by prompt (lookahead.bench), bf16 by default.

    .venv/bin/python benchmarks/ab_candidates.py --n 8 --max-new-tokens 128
"""

import argparse

import transformers

from lookahead import Lookahead, bench, datasets, models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    with_lookup, without = Lookahead(), Lookahead(context_lookup=False)
    methods = [
        *bench.methods_for()[:2],  # greedy, prompt lookup
        bench.Method("auto", lambda: {"custom_generate": with_lookup}, with_lookup),
        bench.Method("auto, no suffix lookup", lambda: {"custom_generate": without}, without),
    ]
    for name in args.datasets:
        runs = bench.run_bench(model, tokenizer, datasets.load(name, args.n), methods, args.max_new_tokens, False)
        print(bench.markdown(bench.summarize(runs), f"{name} ({args.model}, {args.dtype}, n={args.n}, "
                             f"{args.max_new_tokens} new tokens)"))  # fmt: skip
        print("settings chosen on the last prompt:", with_lookup.last_stats.settings, without.last_stats.settings)


if __name__ == "__main__":
    main()
