"""Which fixed (W, N, G) is fastest on a CPU? A sweep of a few settings on the bundled model,
each alternating with plain greedy in one process, over two code and two chat prompts.

Prints, per setting, the median per-prompt speedup over plain ``model.generate`` and the mean
tokens per step. It picked the CPU default in ``lookahead/config.py`` (``_DEFAULTS``).

    .venv/bin/python benchmarks/pick_default.py --dtype float32 --new-tokens 64   # lookahead/config.py
    .venv/bin/python benchmarks/pick_default.py --new-tokens 4 --settings 0,4,4   # smallest, seconds
"""

import argparse
import os
import statistics
import time

import torch

from lookahead import Lookahead, models

PROMPTS = [
    (False, 'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards."""\n'),
    (
        False,
        "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
        '    """From a list of integers, return the list of maxima seen so far."""\n',
    ),
    (True, "Write a short poem about the sea."),
    (True, "Explain in three sentences what a hash table is."),
]
SETTINGS = [(0, 4, 4), (0, 6, 6), (1, 4, 4), (2, 4, 4), (3, 4, 4), (4, 4, 4), (5, 3, 5)]


def parse_setting(text: str) -> tuple[int, int, int]:
    """Read "W,N,G" as (W, N, G)."""
    try:
        w, n, g = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give W,N,G, e.g. 0,4,4") from None
    return w, n, g


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a bundled model or a checkpoint folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=SETTINGS, help="W,N,G each")
    args = parser.parse_args()
    model, tok = models.load(args.model, dtype=args.dtype)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, dtype {args.dtype}")
    ratios = {s: [] for s in args.settings}
    tps = {s: [] for s in args.settings}
    for chat, text in PROMPTS:
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        inputs = tok(text, return_tensors="pt", add_special_tokens=not chat)
        kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
        model.generate(**inputs, max_new_tokens=4)  # warm-up
        for setting in args.settings:
            start = time.perf_counter()
            model.generate(**inputs, **kw)
            plain = time.perf_counter() - start
            la = Lookahead(*setting)
            start = time.perf_counter()
            model.generate(**inputs, custom_generate=la, **kw)
            ours = time.perf_counter() - start
            ratios[setting].append(plain / ours)
            tps[setting].append(la.last_stats.tokens_per_step)
    print("| W,N,G | median speedup | tokens/step |")
    print("|---|---|---|")
    for s in args.settings:
        print(f"| {s} | {statistics.median(ratios[s]):.2f}x | {statistics.mean(tps[s]):.2f} |")


if __name__ == "__main__":
    main()
