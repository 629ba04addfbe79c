"""The cost curve at several context lengths: T(k)/T(1) for a step of k new tokens (one candidate of
k-1 tokens, the 4D mask a lookahead step uses) after c cached tokens. The tuner measures its curve at
c = 64; this shows how far that carries to the contexts a 256-token generation reaches.

    .venv/bin/python benchmarks/cost_by_context.py --contexts 64 256 512
"""

import argparse

import torch
import transformers

from lookahead import costs, models
from lookahead.layout import build_layout
from lookahead.runner import DecoderRunner
from lookahead.support import check_model


@torch.no_grad()  # as generate runs: autograd would time (and keep) a graph per pass
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, _ = models.load(args.model, dtype=args.dtype)
    spec = check_model(model)
    print("| context | T(1) ms | " + " | ".join(f"T({k})/T(1)" for k in args.counts[1:]) + " |")
    print("|---|---|" + "---|" * (len(args.counts) - 1))
    for context in args.contexts:
        runner = DecoderRunner(model, spec)
        runner.prefill([[1] * context])

        def step(k: int, runner=runner) -> None:
            runner.step(build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1), [[1] * k])
            runner.cache.crop(-k)

        curve = costs.measure(step, counts=args.counts, pairs=3)
        ratios = " | ".join(f"{curve.ratio(k):.2f}" for k in args.counts[1:])
        print(f"| {context} | {1000 * curve(1):.1f} | {ratios} |")


if __name__ == "__main__":
    main()
