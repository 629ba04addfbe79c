"""How many verification rows the token tree saves: fixed W/N/G settings on real prompts, every
step's candidates counted as separate chains and as a tree (one row per distinct prefix). Rows are
what a step costs where the cost curve is steep, and what bounds G where it is flat.

    .venv/bin/python benchmarks/tree_rows.py --n 5 --max-new-tokens 64 --settings 0,4,4 0,5,15
"""

import argparse

import transformers

from lookahead import Lookahead, datasets, models
from lookahead.runner import DecoderRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--settings", nargs="+", default=["0,4,4", "0,5,15"])
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    counts = {}
    original = DecoderRunner.step

    def step(self, layout, step_ids):
        if layout.candidate_slots:
            counts["steps"] += 1
            counts["chains"] += sum(len(c) for c in layout.candidate_slots)
            counts["tree"] += len(layout.node_slots)
            counts["input"] += layout.length
        return original(self, layout, step_ids)

    DecoderRunner.step = step
    print("| dataset | W,N,G | steps with candidates | candidate tokens as chains (mean/step) | "
          "as a tree (mean/step) | rows saved | step input, tree (mean) | tokens/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        prompts = datasets.load(name, args.n)
        for setting in args.settings:
            w, n, g = (int(x) for x in setting.split(","))
            counts.update(steps=0, chains=0, tree=0, input=0)
            tokens = steps = 0
            for prompt in prompts:
                lookahead = Lookahead(w, n, g)
                inputs = datasets.encode(tokenizer, prompt)
                model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate=lookahead)
                tokens, steps = tokens + lookahead.last_stats.new_tokens, steps + lookahead.last_stats.steps
            s = max(1, counts["steps"])
            print(f"| {name} | {setting} | {counts['steps']} | {counts['chains'] / s:.1f} | {counts['tree'] / s:.1f} | "
                  f"{1 - counts['tree'] / max(1, counts['chains']):.0%} | {counts['input'] / s:.1f} | "
                  f"{tokens / steps:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
