"""Would a *substitution* source pay? Counted offline over the stored greedy texts, no model run.

Drafts that accept nothing cost the dear-width curves most (issue 14), and in most of them no
earlier occurrence of the context's suffix held the text's next token. One source the drafter
lacks: the text rejoining an earlier passage after one token that differs (a renamed variable,
one word changed). At each output position i (the text before it, ``ctx``), the places j where
the L tokens before ``ctx``'s last one occurred earlier propose ``ctx[j + 1]`` when
``ctx[j] != ctx[-1]`` (the last token *substituted* for ``ctx[j]``), and ``ctx[j]`` (the last
token *inserted*). Reported per dataset and L: positions, those whose next token no suffix
occurrence held (any suffix of 1-3 tokens, every earlier occurrence: a superset of the drafter's
trie, which keeps the 4 newest per suffix),
and how often each proposal was made and was right, there and overall:

    .venv/bin/python benchmarks/substitution_source.py    # results/greedy-texts-smollm2-bfloat16-20x256.json
"""

import argparse
import collections
import json


def count(rows: list[dict], context: int) -> collections.Counter:
    tally = collections.Counter()
    for row in rows:
        text, start = row["ids"] + row["output"], len(row["ids"])
        for i in range(start, len(text)):
            ctx, nxt = text[:i], text[i]
            held = {
                ctx[end + 1] for m in (1, 2, 3) for end in range(m - 1, i - 1) if ctx[end - m + 1 : end + 1] == ctx[-m:]
            }
            substituted, inserted = set(), set()
            if i - 1 - context >= 0:
                key = ctx[i - 1 - context : i - 1]
                for j in range(context, i - 1):
                    if ctx[j - context : j] == key:
                        if j + 1 < i and ctx[j] != ctx[-1]:
                            substituted.add(ctx[j + 1])
                        inserted.add(ctx[j])
            tally["positions"] += 1
            tally["substitution proposed"] += bool(substituted)
            tally["substitution right"] += nxt in substituted
            if nxt not in held:
                tally["no suffix source held it"] += 1
                tally["  substitution proposed there"] += bool(substituted)
                tally["  substitution right there"] += nxt in substituted
                tally["  insertion right there"] += nxt in inserted
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", default="results/greedy-texts-smollm2-bfloat16-20x256.json",
                        help="made by benchmarks/draft_replay.py")  # fmt: skip
    parser.add_argument("--context", type=int, nargs="+", default=[2, 3, 4], help="L: tokens matched before the last")
    args = parser.parse_args()
    rows = json.loads(open(args.texts).read())
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for context in args.context:
            tally = count([r for r in rows if r["dataset"] == name], context)
            print(f"{name}, L = {context}: " + ", ".join(f"{k.strip()} {v}" for k, v in tally.items()))


if __name__ == "__main__":
    main()
