"""How fast does `lookahead serve` answer concurrent clients, against --plain, on the same load?

Starts three servers on free ports of 127.0.0.1 (lookahead with its warm pool shared across
requests, the default; lookahead with --no-shared-pool; and --plain one-token steps; idle
servers wait without using the CPU), then for each concurrency level runs the same requests
against each in turn: C clients, each sending its share of the requests one after another,
streamed, greedy. Each server first answers one short warm-up request (a process's first forward
passes are slow), and with ``--repeats`` each level runs that many rounds, the server that goes
first rotating (a machine whose speed drifts would otherwise favour whoever runs last); the table
gives medians. Each level and round takes prompts of its own (a prompt is never sent twice to a
server, so the warm pool never holds a request's own answer; it holds the answers of earlier,
different prompts). Reports requests/s, output tokens/s, time to first token (TTFT), time per output token
after the first (TPOT) and the gap between streamed chunks (ITL), p50 and p99. Every request is
bounded (max_tokens, a timeout) and so is the run; the servers are stopped at the end.

Prints a table per concurrency level and server (medians over the rounds); writes it and every
round's figures under ``--out`` (``serve-load.md``, ``serve-load.json``).

    .venv/bin/python benchmarks/serve_load.py --dataset humaneval --clients 1 4 16 --requests 16 --max-tokens 128 \
        --repeats 3                                                             # docs/serving.md
    .venv/bin/python benchmarks/serve_load.py --clients 1 --requests 1 --max-tokens 8   # smallest: a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _servers
import openai

from lookahead import datasets

# name -> options of lookahead serve
SERVERS = {"lookahead": (), "lookahead, no shared pool": ("--no-shared-pool",), "plain": ("--plain",)}


def start(args, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _servers.free_port()
    cmd = [sys.executable, "-m", "lookahead.cli", "serve", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--port", str(port), "--max-batch-size", str(args.max_batch_size), *extra]
    return _servers.start(cmd, port, timeout=300)


async def one_request(api, model: str, prompt: datasets.Prompt, max_tokens: int) -> dict:
    """One streamed greedy request: chat prompts through /v1/chat/completions."""
    start = time.perf_counter()
    arrivals, usage = [], None
    common = dict(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    if prompt.chat:
        messages = [{"role": "user", "content": prompt.text}]
        stream = await api.chat.completions.create(messages=messages, **common)
    else:
        stream = await api.completions.create(prompt=prompt.text, **common)
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content if prompt.chat else chunk.choices[0].text):
            arrivals.append(time.perf_counter() - start)
        if chunk.usage:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage else 0
    end = time.perf_counter() - start
    ttft = arrivals[0] if arrivals else end
    return {
        "ttft": ttft,
        "e2e": end,
        "tokens": tokens,
        "tpot": (end - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
    }


async def load(
    url: str, model: str, prompts: list[datasets.Prompt], clients: int, max_tokens: int, timeout: float
) -> dict:
    queue = list(prompts)
    results = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout) as api:

        async def client():
            while queue:
                results.append(await one_request(api, model, queue.pop(0), max_tokens))

        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout)
        wall = time.perf_counter() - start

    def pct(values, q):
        values = sorted(v for v in values if v is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    tokens = sum(r["tokens"] for r in results)
    itl = [gap for r in results for gap in r["itl"]]
    return {
        "requests": len(results),
        "seconds": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(r["ttft"] for r in results),
        "ttft_p99": pct([r["ttft"] for r in results], 0.99),
        "tpot_p50": pct([r["tpot"] for r in results], 0.5),
        "tpot_p99": pct([r["tpot"] for r in results], 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "output_tokens": tokens,
    }


def markdown(rows: list[dict], args) -> str:
    """One line per (clients, server): medians over the repeats; "vs plain" is the median of each
    round's ratio to plain's output tokens/s in the same round."""
    lines = [
        f"### serve load ({args.model}, {args.dtype}, {args.dataset}, {args.requests} requests x "
        f"{args.max_tokens} tokens, batch <= {args.max_batch_size}, medians of {args.repeats} rounds)",
        "",
        "| clients | server | req/s | output tok/s | vs plain | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
        "ITL p50 / p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {(r["clients"], r["repeat"]): r["output_tokens_per_s"] for r in rows if r["server"] == "plain"}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["clients"], r["server"]), []).append(r)
    for (clients, server), mine in groups.items():

        def med(key: str, scale: float = 1.0, mine: list[dict] = mine) -> float:
            return scale * statistics.median(r[key] for r in mine)

        ratio = statistics.median(r["output_tokens_per_s"] / plain[(r["clients"], r["repeat"])] for r in mine)
        lines.append(
            f"| {clients} | {server} | {med('requests_per_s'):.2f} | {med('output_tokens_per_s'):.1f} | "
            f"{ratio:.2f}x | {med('ttft_p50'):.2f} / {med('ttft_p99'):.2f} | "
            f"{med('tpot_p50', 1000):.0f} / {med('tpot_p99', 1000):.0f} | "
            f"{med('itl_p50', 1000):.0f} / {med('itl_p99', 1000):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="humaneval", help="humaneval | mtbench | FILE.jsonl")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per level and server")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="rounds per level, each with prompts of its own")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a level may take at most")
    parser.add_argument("--out", default="results/serve-load")
    args = parser.parse_args()
    rounds = [(clients, repeat) for clients in args.clients for repeat in range(args.repeats)]
    prompts = datasets.load(args.dataset, args.requests * len(rounds))
    if len(prompts) < args.requests * len(rounds):
        raise SystemExit(f"{args.dataset} has {len(prompts)} prompts: lower --requests, --repeats or the levels")
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    rows = []
    try:  # the servers started so far are stopped, whatever fails
        for name, extra in SERVERS.items():
            servers[name] = start(args, *extra)
        warm = [datasets.Prompt(id="warm-up", text="Say hello.", chat=True)]  # a first request pays a process's warm-up
        for _, url in servers.values():
            asyncio.run(load(url, args.model, warm, 1, 8, args.timeout))
        names = list(servers)
        for index, (clients, repeat) in enumerate(rounds):
            batch = prompts[index * args.requests : (index + 1) * args.requests]
            order = names[repeat % len(names) :] + names[: repeat % len(names)]  # who goes first rotates
            for name in order:  # the same load, one server after the other
                url = servers[name][1]
                result = asyncio.run(load(url, args.model, batch, clients, args.max_tokens, args.timeout))
                rows.append({"clients": clients, "repeat": repeat, "server": name, **result})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            _servers.stop(proc, timeout=120)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args)
    (out / "serve-load.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "serve-load.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
