"""Does weighting a batch's steps towards the sequences furthest from their end make it faster?

``generate`` returns when its last sequence ends, so ``Lookahead()`` weighs each sequence's
tokens by (tokens it may still emit / the most any may) ** ``Engine.laggard_power`` (4) when it
prices a batch's step (``lookahead.engine.Engine._weights``); power 0 counts every sequence's
tokens alike (tokens per second, as before). Each power in ``--powers`` runs against greedy on
the same batches, alternating batch by batch (``lookahead.bench.run_bench``), bf16 by default.
Prints and writes as ``ab_batch_costs.py`` does, whose options it shares.

    .venv/bin/python benchmarks/ab_laggards.py --n 32 --batch-size 4 8          # docs/batches.md
    .venv/bin/python benchmarks/ab_laggards.py --n 2 --max-new-tokens 8 --datasets humaneval \\
        --batch-size 2                                                          # smallest: seconds
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
