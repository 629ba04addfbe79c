"""A/B: ``Lookahead()`` pricing its steps with one cost curve or another, against greedy.

Every curve is a JSON file of [tokens, seconds] points, or ``stored``: the curve this machine
stores for the model (``decoding.model_cost_curve``, measured once if missing). Both run the same
prompts, alternating prompt by prompt (``lookahead.bench.run_bench``); only the steps' shapes can
differ, never the outputs (fp32: identical to greedy). E.g. the calibration's grid before
``c4677d5`` (curves of 2026-12-05, in the repository's history as ``docs/cost-curves-full-grid-2026-12-05.json``):

    .venv/bin/python benchmarks/ab_curves.py --dtype float32 --n 16 --max-new-tokens 256 \\
        --curves stored old-grid.json
"""

import argparse
import json
from pathlib import Path

import transformers

from lookahead import Lookahead, bench, datasets, models
from lookahead.decoding import model_cost_curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--curves", nargs="+", default=["stored"], help="JSON files of points, or stored")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    methods = [bench.methods_for()[0]]  # greedy
    for name in args.curves:
        points = model_cost_curve(model).points if name == "stored" else json.loads(Path(name).read_text())
        lookahead = Lookahead(cost_curve=points)
        methods.append(bench.Method(f"curve {name}", lambda la=lookahead: {"custom_generate": la}, lookahead))
    print("| dataset | method | speedup (median) | (geometric mean) | tokens/s | tokens/step | identical |")
    print("|---|---|---|---|---|---|---|")
    for name in args.datasets:
        runs = bench.run_bench(model, tokenizer, datasets.load(name, args.n), methods, args.max_new_tokens, False)
        for row in bench.summarize(runs):
            print(
                f"| {name} | {row['method']} | {row['speedup']:.3f}x | {row['speedup_geomean']:.3f}x | "
                f"{row['tokens_per_second']:.1f} | {row['tokens_per_step']:.2f} | {row['identical']:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
