"""How long does a running stream stall while a long prompt joins the batch, with and without
chunked prefill (`lookahead serve --prefill-chunk`)?

In one process (one service, its model loaded on its engine thread, as `lookahead serve` does),
for each chunk size in turn (a size at least as long as the prompt is one pass: no chunking), the
service streams a request; once it has produced ``--warm`` tokens, a request with a prompt of
``--long-tokens`` tokens arrives. The report gives, for the stream, the worst and the median gap
between its token reports while the long prompt was prefilled, and the long request's time to
first token. Chunk sizes alternate over ``--repeats`` rounds; medians are printed, and ``--out``
keeps them and every round as JSON.

    .venv/bin/python benchmarks/prefill_gap.py --long-tokens 1700 --chunks 100000 512 256 --repeats 3  # docs/serving.md
    .venv/bin/python benchmarks/prefill_gap.py --long-tokens 64 --chunks 1000 16 --repeats 1   # smallest
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from lookahead import LookaheadConfig, models
from lookahead.service import Request, Service

STREAM_PROMPT = "def fibonacci(n):\n    "


async def one_round(service: Service, stream_ids: list[int], long_ids: list[int], warm: int) -> dict:
    """Stream, then let the long prompt arrive -> the stream's gaps while it was prefilled (up to
    the stream's first report after the long request's first token) and the long request's TTFT."""
    stream = Request(prompt_ids=stream_ids, max_tokens=10_000)
    service.submit(stream)
    seen = 0
    while seen < warm:
        seen += len((await stream.events.get()).tokens)
    long = Request(prompt_ids=long_ids, max_tokens=1)
    stamps = [time.perf_counter()]
    service.submit(long)
    joined = asyncio.Event()

    async def watch():  # the stream's reports, until one comes after the long request's first token
        while True:
            event = await stream.events.get()
            stamps.append(time.perf_counter())
            if joined.is_set() or event.finish_reason:
                return

    watcher = asyncio.create_task(watch())
    await long.events.get()
    ttft = time.perf_counter() - stamps[0]
    joined.set()
    await asyncio.wait_for(watcher, 120)
    service.cancel(stream)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"worst_gap": max(gaps), "median_gap": statistics.median(gaps), "ttft": ttft, "gaps": len(gaps)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--long-tokens", type=int, default=1700)
    parser.add_argument("--chunks", type=int, nargs="+", default=[100_000, 512, 256])
    parser.add_argument("--warm", type=int, default=8, help="stream tokens before the long prompt arrives")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    loaded = {}

    def load():  # on the engine thread, as lookahead serve loads it (see lookahead.service)
        model, loaded["tokenizer"] = models.load(args.model, dtype=args.dtype)
        return model

    service = Service(load, LookaheadConfig.default_for("cpu"))
    tokenizer = loaded["tokenizer"]
    stream_ids = tokenizer(STREAM_PROMPT)["input_ids"]
    filler = tokenizer("The quick brown fox jumps over the lazy dog. " * (args.long_tokens // 8 + 1))["input_ids"]
    long_ids = filler[: args.long_tokens]
    results: dict[int, list[dict]] = {chunk: [] for chunk in args.chunks}
    try:  # one service (one engine thread), its chunk size changed between rounds, in turn
        for round_ in range(args.repeats):
            order = args.chunks[round_ % len(args.chunks) :] + args.chunks[: round_ % len(args.chunks)]
            for chunk in order:
                service.prefill_chunk = chunk
                results[chunk].append(asyncio.run(one_round(service, stream_ids, long_ids, args.warm)))
    finally:
        service.shutdown(timeout=60)
    rows = {
        chunk: {key: round(statistics.median(r[key] for r in runs), 4) for key in ("worst_gap", "median_gap", "ttft")}
        for chunk, runs in results.items()
    }
    print(f"{args.model} ({args.dtype}), a {len(long_ids)}-token prompt joins a running stream; "
          f"medians of {args.repeats} rounds\n")  # fmt: skip
    print("| prefill chunk | stream's worst gap (s) | median gap (s) | long prompt's TTFT (s) |\n|---|---|---|---|")
    for chunk, row in rows.items():
        label = "one pass" if chunk >= len(long_ids) else str(chunk)
        print(f"| {label} | {row['worst_gap']:.3f} | {row['median_gap']:.3f} | {row['ttft']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                        "runs": results}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
