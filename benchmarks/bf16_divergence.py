"""How often does bf16 lookahead output differ from plain bf16 greedy, where, and why?

Runs 2n prompts (n HumanEval, n MT-bench) on the model in bf16 with plain greedy, Lookahead
(given W/N/G) and transformers' prompt lookup decoding. For each output that differs from plain
greedy it reports the first differing token and, from plain greedy's own logits at that position,
the gap between its top two tokens: near-ties that a different batch shape (and so a different
bf16 summation order) can flip. Writes ``--out`` (JSON, one row per prompt and method) and prints a
table.

    .venv/bin/python benchmarks/bf16_divergence.py --n 10 --new-tokens 64       # docs/exactness.md
    .venv/bin/python benchmarks/bf16_divergence.py --n 1 --new-tokens 8         # smallest, seconds
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from lookahead import Lookahead, datasets, models


@torch.no_grad()
def top2_gap(model, sequence, position):
    """Plain greedy's logit gap between its top-2 tokens when it chose sequence[position]."""
    logits = model(input_ids=sequence[None, :position]).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return (top[0] - top[1]).item(), top[0].item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a bundled model or a checkpoint folder")
    parser.add_argument("--n", type=int, default=10, help="prompts per dataset")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("-W", type=int, default=4)
    parser.add_argument("-N", type=int, default=4)
    parser.add_argument("-G", type=int, default=4)
    parser.add_argument("--out", default="results/bf16_divergence.json")
    args = parser.parse_args()
    model, tok = models.load(args.model, dtype="bfloat16")
    prompts = datasets.humaneval(args.n) + datasets.mtbench(args.n)
    methods = {
        f"lookahead({args.W},{args.N},{args.G})": lambda: dict(custom_generate=Lookahead(args.W, args.N, args.G)),
        "prompt_lookup(3)": lambda: dict(prompt_lookup_num_tokens=3),
    }
    rows = []
    for prompt in prompts:
        inputs = datasets.encode(tok, prompt)
        start = inputs["input_ids"].shape[1]
        kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
        plain = model.generate(**inputs, **kw)[0]
        for name, extra in methods.items():
            out = model.generate(**inputs, **kw, **extra())[0]
            n = min(len(out), len(plain))
            diff = (out[:n] != plain[:n]).nonzero()
            row = {"prompt": prompt.id, "method": name, "identical": out.tolist() == plain.tolist()}
            if len(diff):
                pos = diff[0].item()
                gap, top = top2_gap(model, plain, pos)
                row.update(first_diff=pos - start, top2_gap=gap, top_logit=top)
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(
        "\n| method | identical to plain bf16 | first differing token (median, range) "
        "| top-2 logit gap there (median, max) |"
    )
    print("|---|---|---|---|")
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        bad = [r for r in mine if not r["identical"]]
        same = f"{len(mine) - len(bad)}/{len(mine)}"
        if bad:
            firsts = [r["first_diff"] for r in bad]
            gaps = [r["top2_gap"] for r in bad]
            print(
                f"| {name} | {same} | {statistics.median(firsts):.0f} ({min(firsts)}-{max(firsts)}) | "
                f"{statistics.median(gaps):.3f} ({max(gaps):.3f}) |"
            )
        else:
            print(f"| {name} | {same} | - | - |")


if __name__ == "__main__":
    main()
