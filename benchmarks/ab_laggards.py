"""A/B: a batch's steps weighted towards the sequences furthest from their end, or not.

``generate`` returns when its last sequence ends, so ``Lookahead()`` weighs each sequence's
tokens by (tokens it may still emit / the most any may) ** ``Engine.laggard_power`` (4) when it
prices a batch's step (``lookahead.engine.Engine._weights``); power 0 counts every sequence's
tokens alike (tokens per second, as before). Both run against greedy on the same batches,
alternating batch by batch (``lookahead.bench.run_bench``), bf16 by default:

    .venv/bin/python benchmarks/ab_laggards.py --datasets humaneval mtbench --batch-size 4 8
"""

import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).parent))
from ab_batch_costs import batch_parser, compare_batches  # noqa: E402

from lookahead import Lookahead, bench, engine, models  # noqa: E402


def main() -> None:
    parser = batch_parser(__doc__)
    parser.add_argument("--powers", type=float, nargs="+", default=[engine.Engine.laggard_power, 0.0])
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
    compare_batches(model, tokenizer, methods, args)


if __name__ == "__main__":
    main()
