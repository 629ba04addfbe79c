"""Tokens per step while sampling on the bundled model (HumanEval and MT-bench prompts).

    .venv/bin/python benchmarks/sampling_tps.py --n 5 --new-tokens 96

Tokens per step is a property of the text and the acceptance rule, not of speed, so fp32 is used.
"""

import argparse
import statistics

import torch

from lookahead import Lookahead, datasets, models


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--settings", default="4,4,4;0,4,4")
    args = parser.parse_args()
    model, tok = models.load("smollm2", dtype="float32")
    settings = [tuple(int(x) for x in s.split(",")) for s in args.settings.split(";")]
    print("| dataset | temperature | W,N,G | tokens/step (mean over prompts) | greedy tokens/step |")
    print("|---|---|---|---|---|")
    for name, prompts in (("humaneval", datasets.humaneval(args.n)), ("mtbench", datasets.mtbench(args.n))):
        for setting in settings:
            greedy = []
            for prompt in prompts:
                la = Lookahead(*setting)
                model.generate(**datasets.encode(tok, prompt), max_new_tokens=args.new_tokens, custom_generate=la)
                greedy.append(la.last_stats.tokens_per_step)
            for temperature in (0.7, 1.0):
                tps = []
                for i, prompt in enumerate(prompts):
                    torch.manual_seed(i)
                    la = Lookahead(*setting)
                    model.generate(
                        **datasets.encode(tok, prompt),
                        do_sample=True,
                        temperature=temperature,
                        top_k=0,
                        top_p=1.0,
                        max_new_tokens=args.new_tokens,
                        custom_generate=la,
                    )
                    tps.append(la.last_stats.tokens_per_step)
                print(
                    f"| {name} | {temperature} | {setting} | {statistics.mean(tps):.2f} | "
                    f"{statistics.mean(greedy):.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
