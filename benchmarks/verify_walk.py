"""Greedy verification of a batch: the per-sequence Python walk against a walk in tensor ops.

Issue 13 asks that work growing with the batch run as tensor operations over the batch. This
times the one part of a step where that is plainly possible, the greedy walk through the
candidates (``choices.fetch_matched`` then ``verify.verify_choices`` per sequence), against the
same walk over [B, G] tensors, depth by depth. It runs on a CPU, for (15, 5, 15) at batch 8 with a
49k vocabulary in bf16. Both compute the argmax lazily (only the rows the walk reads), and both
give the same emitted tokens (asserted).

    .venv/bin/python benchmarks/verify_walk.py              # SmolLM2's 49k vocabulary
    .venv/bin/python benchmarks/verify_walk.py --vocab 64   # the bookkeeping alone

2026-12-03, this machine, two runs each: with the 49k vocabulary, where the argmax dominates,
4.0-5.7 ms per step either way, ahead by turns and within 0.5 ms. With ``--vocab 64``, where only
the bookkeeping is left: Python 0.36-0.40 ms, tensors 0.58-0.63 ms. The tensor walk runs about
ten small ops per depth at 5-10 us each. The Python walk only touches 8 x 15 short tuples. At
this size, on this CPU, the tensor walk is the slower one, so the engine keeps the Python walk.
"""

from __future__ import annotations

import argparse
import array
import random
import timeit

import torch

from lookahead.choices import StepChoices, fetch_matched, greedy_choices
from lookahead.layout import build_layout
from lookahead.verify import verify_choices

BATCH, W, N, G, VOCAB = 8, 15, 5, 15, 49152
DEPTH = N - 1


def candidates_for(layout, choices: torch.Tensor, seed: int = 0) -> list[list[tuple[int, ...]]]:
    """Per sequence, G candidates that agree with the model for a random number of tokens."""
    rng = random.Random(seed)
    index = layout.logit_index
    out = []
    for b in range(BATCH):
        t_choice = int(choices[b, index[layout.t_slot]])
        mine = []
        for k in range(G):
            tokens = [t_choice if rng.random() < 0.5 else 7]
            for j in range(1, DEPTH):
                before = int(choices[b, index[layout.candidate_slots[k][j - 1]]])
                tokens.append(before if rng.random() < 0.6 else 3)
            mine.append(tuple(tokens[: rng.randint(1, DEPTH)]))
        out.append(mine)
    return out


def python_walk(logits, layout, candidates) -> list[list[int]]:
    choices = StepChoices(logits, lazy=True)
    fetch_matched(choices, layout, candidates)
    index = layout.logit_index
    emitted = []
    for b in range(BATCH):
        row = choices.sequence(b)

        def predict(k: int, j: int, row=row) -> int:
            return row[index[layout.candidate_slots[k][j]]]

        emitted.append(list(verify_choices(row[index[layout.t_slot]], candidates[b], predict).emitted))
    return emitted


def tensor_walk(logits, layout, candidates, slot_index: torch.Tensor) -> list[list[int]]:
    index = layout.logit_index
    leading = len({index[layout.t_slot], *(index[s] for s in layout.last_level_slots)})
    first_choices = greedy_choices(logits[:, :leading])  # t and the window's last level, as the engine
    packed, pad = array.array("q"), [-1] * DEPTH
    for mine in candidates:
        for tokens in mine:
            packed.extend(tokens)
            packed.extend(pad[: DEPTH - len(tokens)])
        packed.extend(pad * (G - len(mine)))
    tokens = torch.frombuffer(packed, dtype=torch.long).view(BATCH, G, DEPTH)
    kept = logits.shape[1]
    base = torch.arange(BATCH) * kept
    before = first_choices[:, index[layout.t_slot]]  # [B]: the model's choice before this depth
    alive = tokens[:, :, 0] == before[:, None]  # [B, G]
    columns = [before]
    for depth in range(DEPTH):
        agree = alive.any(1)  # [B]
        if not bool(agree.any()):
            break
        first = alive.byte().argmax(1)  # [B]: the first candidate still agreeing
        predicted = torch.full_like(before, -1)
        predicted[agree] = greedy_choices(logits, (base + slot_index[first, depth])[agree])
        columns.append(predicted)
        if depth + 1 < DEPTH:
            alive = alive & (tokens[:, :, depth + 1] == predicted[:, None])
        before = predicted
    return [[token for token in row if token >= 0] for row in torch.stack(columns, 1).tolist()]


def main() -> None:
    global VOCAB
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=VOCAB, help="a small one leaves the walk's bookkeeping alone")
    VOCAB = parser.parse_args().vocab
    torch.manual_seed(0)
    layout = build_layout(1, W, N - 1, G, DEPTH)
    logits = torch.randn(BATCH, len(layout.logit_slots), VOCAB, dtype=torch.bfloat16)
    candidates = candidates_for(layout, greedy_choices(logits))
    slot_index = torch.tensor([[layout.logit_index[s] for s in slots] for slots in layout.candidate_slots])
    assert python_walk(logits, layout, candidates) == tensor_walk(logits, layout, candidates, slot_index)
    runs = {
        "python": lambda: python_walk(logits, layout, candidates),
        "tensors": lambda: tensor_walk(logits, layout, candidates, slot_index),
    }
    for _ in range(2):  # alternating
        for name, run in runs.items():
            best = min(timeit.repeat(run, number=50, repeat=5)) / 50
            print(f"{name}: {1000 * best:.2f} ms per step")


if __name__ == "__main__":
    main()
