"""Sweep a few (W, N, G) on the bundled model, alternating with plain greedy in one process.

    .venv/bin/python benchmarks/pick_default.py --dtype float32 --new-tokens 64

Prints, per setting, the median per-prompt speedup over plain model.generate and the mean
tokens per step. Used to pick the CPU default in lookahead/config.py.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model, tok = models.load("smollm2", dtype=args.dtype)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, dtype {args.dtype}")
    ratios = {s: [] for s in SETTINGS}
    tps = {s: [] for s in SETTINGS}
    for chat, text in PROMPTS:
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        inputs = tok(text, return_tensors="pt", add_special_tokens=not chat)
        kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
        model.generate(**inputs, max_new_tokens=4)  # warm-up
        for setting in SETTINGS:
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
    for s in SETTINGS:
        print(f"| {s} | {statistics.median(ratios[s]):.2f}x | {statistics.mean(tps[s]):.2f} |")


if __name__ == "__main__":
    main()
