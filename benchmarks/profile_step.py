"""Where a lookahead call's time goes: forward passes, verification, pool and lookup, cache
bookkeeping, the rest of the loop. cProfile over one call on a HumanEval prompt.

    .venv/bin/python benchmarks/profile_step.py --dtype bfloat16 -W 4 -N 4 -G 4
    .venv/bin/python benchmarks/profile_step.py --dtype bfloat16          # Lookahead(): auto
"""

import argparse
import cProfile
import pstats

import transformers

from lookahead import Lookahead, datasets, models

GROUPS = {  # phase -> (file suffix, function name) pairs whose cumulative time it is
    "forward (model)": [("runner.py", "step"), ("runner.py", "prefill")],
    "verification (scoring, processors, acceptance)": [("engine.py", "_verify"), ("tuning.py", "match_lengths")],
    "pool, window, suffix lookup": [
        ("planning.py", "plan_step"),
        ("engine.py", "_pool_output"),
        ("window.py", "update"),
    ],
    "count drafting (sources, trie, tree, scoring)": [
        ("planning.py", "draft_sources"),
        ("drafting.py", "draft"),
        ("drafting.py", "record"),
    ],
    "auto-tuning (pricing options, choosing)": [
        ("planning.py", "step_sizes"),
        ("tuning.py", "choose"),
        ("tuning.py", "after_step"),
        ("tuning.py", "record"),
    ],
    "cache bookkeeping (gather, crop, drop rows)": [("runner.py", "commit"), ("runner.py", "select")],
    "emission (stopping criteria, output)": [("emission.py", "emit")],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", type=int, default=3, help="HumanEval prompt index")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-W", type=int, help="fixed W/N/G; none given: Lookahead() (auto)")
    parser.add_argument("-N", type=int)
    parser.add_argument("-G", type=int)
    parser.add_argument("--off", nargs="*", default=[], help="Lookahead flags to turn off (e.g. token_tree)")
    parser.add_argument("--dataset", default="humaneval", choices=["humaneval", "mtbench"])
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load("smollm2", dtype=args.dtype)
    prompt = datasets.load(args.dataset)[args.prompt]  # in file order
    inputs = datasets.encode(tokenizer, prompt)
    lookahead = Lookahead(args.W, args.N, args.G, **dict.fromkeys(args.off, False))
    model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=lookahead)  # warm up
    profiler = cProfile.Profile()
    profiler.enable()
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate=lookahead)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "__call__" and ct)
    s = lookahead.last_stats
    name = "auto" if lookahead.config_for("cpu").adaptive else f"{args.W},{args.N},{args.G}"
    print(f"### Step profile: Lookahead({name}), {args.dtype}, {args.dataset}/{args.prompt}, "
          f"{s.new_tokens} tokens in {s.steps} steps ({s.tokens_per_step:.2f} tokens/step)\n")  # fmt: skip
    print("| phase | seconds | share of the call | per step (ms) |\n|---|---|---|---|")
    accounted = 0.0
    for phase, keys in GROUPS.items():
        seconds = sum(
            ct for (path, _, name), (_, _, _, ct, _) in stats.items() for suffix, fn in keys
            if path.endswith(suffix) and name == fn
        )  # fmt: skip
        accounted += seconds
        print(f"| {phase} | {seconds:.3f} | {seconds / total:.1%} | {1000 * seconds / s.steps:.2f} |")
    rest = total - accounted
    print(f"| rest of the loop | {rest:.3f} | {rest / total:.1%} | {1000 * rest / s.steps:.2f} |")
    print(f"| **whole call** | {total:.3f} | 100% | {1000 * total / s.steps:.2f} |")
    print(f"\nsettings chosen (steps): {s.settings}")


if __name__ == "__main__":
    main()
