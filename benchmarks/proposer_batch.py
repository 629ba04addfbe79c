"""The vLLM proposer's Python time per call at a full batch, with no vLLM: a simulated engine batch
over greedy texts.

B rows decode their texts (prompt + greedy output, ``draft_replay.greedy_texts``' file) in
lockstep: each call gives ``ChainProposer.propose`` every row's emitted tokens and text, a row
accepts the longest prefix of its draft that its text goes on with plus one token, finished rows
leave (the batch condenses) and the next texts join. The proposer's clock is advanced by a modelled
step (``--step-ms`` + ``--row-ms`` a row + ``--token-ms`` a drafted token: fp32 SmolLM2 at 16 rows
on the 2-core AVX2-only CPU, docs/journal.md), so its pricing sees engine-like costs. The texts run
``--rounds`` times (forwards, then backwards, and so on), so later requests meet a warm pool.

Prints the median milliseconds of ``propose`` over the calls at a full batch, tokens per
request-step, and a digest of every draft: two revisions of the drafter that should draft alike
must print the same digest (``--src`` runs another checkout's ``src``, such as a git worktree).

    .venv/bin/python benchmarks/draft_replay.py --dtype float32 --n 12 --datasets mtbench   # makes the texts
    .venv/bin/python benchmarks/proposer_batch.py --texts results/greedy-texts-smollm2-float32-12x256.json
    git worktree add /tmp/old REV && .venv/bin/python benchmarks/proposer_batch.py --texts ... --src /tmp/old/src
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time


def simulate(proposer_class, clock, accepted, texts: list[dict], args) -> dict:
    """Run the batch to the end; the full-batch calls' Python times, tokens, the drafts' digest.
    ``clock`` and ``accepted``: proposer_replay's (imported once ``--src`` is on the path)."""
    proposer = proposer_class(args.k, 4096, clock=clock)
    queue, active = list(texts), []  # active: [prompt, output, done, emitted]
    seconds, tokens, request_steps, digest = [], 0, 0, hashlib.sha1()
    while queue or active:
        while queue and len(active) < args.batch:
            row = queue.pop(0)
            active.append([list(row["ids"]), list(row["output"]), 1, list(row["output"][:1])])
        started = time.perf_counter()
        drafts = proposer.propose([a[3] for a in active], [a[0] + a[1][: a[2]] for a in active])
        if len(active) == args.batch:
            seconds.append(time.perf_counter() - started)
        digest.update(repr(drafts).encode())
        drafted = sum(map(len, drafts))
        clock.now += (args.step_ms + args.row_ms * len(active) + args.token_ms * drafted) / 1000
        for row, draft in zip(active, drafts, strict=True):
            prompt, output, done, _ = row
            row[3] = output[done : done + accepted(draft, output[done:]) + 1]
            row[2] += len(row[3])
            tokens, request_steps = tokens + len(row[3]), request_steps + 1
        active = [row for row in active if row[2] < len(row[1])]
    return {
        "median_ms_per_call": round(statistics.median(seconds) * 1000, 3),
        "full_batch_calls": len(seconds),
        "tokens_per_request_step": round(tokens / request_steps, 3),
        "drafts_digest": digest.hexdigest()[:12],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", required=True, help="greedy texts (draft_replay.greedy_texts' file)")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=16, help="the proposer's most draft tokens")
    p.add_argument("--rounds", type=int, default=6, help="passes over the texts, alternately reversed")
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--row-ms", type=float, default=0.8)
    p.add_argument("--token-ms", type=float, default=2.3)
    p.add_argument("--src", help="import lookahead from this src folder instead (another revision)")
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    from proposer_replay import Clock, accepted  # imports lookahead: after --src

    from lookahead.proposer import ChainProposer

    with open(args.texts) as f:
        rows = [r for r in json.load(f) if r["dataset"] == args.dataset]
    texts = [row for n in range(args.rounds) for row in (rows if n % 2 == 0 else rows[::-1])]
    if len(texts) < args.batch:
        p.error(f"{len(texts)} texts cannot fill a batch of {args.batch}: raise --rounds or lower --batch")
    print(
        json.dumps({"src": args.src or "installed", **simulate(ChainProposer, Clock(), accepted, texts, args)}),
        flush=True,
    )


if __name__ == "__main__":
    main()
