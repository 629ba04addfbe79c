"""A/B: does an option of Lookahead() pay? Lookahead() as it is and with each named option turned
off, against greedy and prompt lookup, alternating prompt by prompt (lookahead.bench), bf16 by
default. The options are Lookahead's keyword flags (context_lookup, token_tree, ...); ``--base``
sets the keyword arguments of both sides (JSON), e.g. a window with count drafting against the
same window with the per-step chooser:

    .venv/bin/python benchmarks/ab_options.py token_tree --n 8 --max-new-tokens 128
    .venv/bin/python benchmarks/ab_options.py count_drafting --dtype float32 \
        --base '{"window_size": 5, "ngram_size": 4, "max_candidates": 4, "adaptive": true}'
"""

import argparse
import json

import transformers

from lookahead import Lookahead, bench, datasets, models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("off", nargs="+", help="flags to turn off, one variant each (e.g. token_tree)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--base", default="{}", help="Lookahead keyword arguments of every variant, as JSON")
    parser.add_argument("--skip-prompt-lookup", action="store_true", help="compare with greedy only (faster)")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    base = json.loads(args.base)
    label = "auto" if not base else ",".join(f"{k}={v}" for k, v in base.items())
    variants = {label: Lookahead(**base)}
    variants.update({f"{label}, no {flag}": Lookahead(**base, **{flag: False}) for flag in args.off})
    methods = bench.methods_for()[: 1 if args.skip_prompt_lookup else 2]  # greedy, prompt lookup
    for name, lookahead in variants.items():
        methods.append(bench.Method(name, lambda la=lookahead: {"custom_generate": la}, lookahead))
    for name in args.datasets:
        runs = bench.run_bench(model, tokenizer, datasets.load(name, args.n), methods, args.max_new_tokens, False)
        print(bench.markdown(bench.summarize(runs), f"{name} ({args.model}, {args.dtype}, n={args.n}, "
                             f"{args.max_new_tokens} new tokens)"))  # fmt: skip
        for variant, lookahead in variants.items():
            print(f"settings chosen on the last prompt, {variant}:", lookahead.last_stats.settings)


if __name__ == "__main__":
    main()
