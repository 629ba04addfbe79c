"""Does `lookahead serve` lose nothing, and stay up, under a long run of mixed and hostile traffic?

A soak and fault test: mixed traffic for a bounded time, on 127.0.0.1 only.

Starts `lookahead serve` on a free loopback port, then runs ``--clients`` workers until
``--seconds`` have passed. Each worker sends, in a seeded order, a mix of: streamed greedy chats
(their inter-chunk gaps are measured), sampled completions with a seed, long prompts (about
``--long-tokens`` tokens), streams the client abandons after a few chunks, streams abandoned
before the first byte, and hostile bodies (nesting 100,000 deep, a 5,000-digit seed, a text part
that is a number, invalid JSON, a body over the size limit, too many stop strings). Every request
has a timeout; the run stops by itself, then sends SIGTERM and waits for the server to exit.

The report (JSON, and a table on stdout):
- requests by kind and outcome: served, refused as they should be (a 4xx in OpenAI's error shape
  for a hostile body), abandoned by the client, and the rest: errors by kind (an unexpected
  status, a 5xx, a body that is not OpenAI's shape, an exception) and **lost** requests (a
  well-formed request whose response never completed: must be 0);
- the server's resident memory over time (sampled every ``--sample-seconds``), and the warm pool's
  entries (from /health);
- the streams' inter-chunk gaps (after the first chunk): p50, p99 and the worst;
- whether /health stayed up, and the server's exit status after SIGTERM.

The exit status is 1 if a request was lost or failed unexpectedly, or the server did not exit 0.

    .venv/bin/python benchmarks/soak.py --seconds 1800 --clients 6 --out docs/results/soak-30min.json  # serving.md
    .venv/bin/python benchmarks/soak.py --seconds 60 --clients 4        # smallest: what tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _servers
import httpx
import psutil

from lookahead import datasets

HOSTILE: list = []  # the hostile bodies, made once (run)
KINDS = {  # kind -> weight in the mix
    "stream": 4,
    "sampled": 3,
    "long": 1,
    "abandon_stream": 1,
    "abandon_early": 1,
    "hostile": 2,
}


def start_server(args) -> tuple[subprocess.Popen, str, object]:
    port = _servers.free_port()
    cmd = [sys.executable, "-m", "lookahead.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--port", str(port), "--max-batch-size", str(args.max_batch_size), *args.server_args]  # fmt: skip
    log = open(args.server_log, "w+b") if args.server_log else tempfile.TemporaryFile()  # noqa: SIM115
    proc, url = _servers.start(cmd, port, timeout=600, log=log)
    return proc, url, log


class Tally:
    """Outcomes by kind, gaps between stream chunks, and what went wrong (a few examples each)."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter = collections.Counter()
        self.gaps: list[float] = []
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if detail and len(self.examples[outcome]) < 5:
            self.examples[outcome].append(f"{kind}: {detail[:300]}")


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "code"} <= set(error)


def hostile_bodies(model: str) -> list[tuple[str, bytes, dict]]:
    """(name, body, extra headers): each must get a 4xx in OpenAI's error shape."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    huge_seed = json.dumps(chat)[:-1] + ', "seed": ' + "9" * 5000 + "}"  # past Python's int() digit limit
    return [
        ("deep nesting", b"[" * 100_000, {}),
        ("5000-digit seed", huge_seed.encode(), {}),
        ("text part not a string",
         json.dumps({**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(), {}),
        ("invalid JSON", b'{"model": ', {}),
        ("body over the limit", b'{"x": "' + b"a" * (8 * 2**20) + b'"}', {}),
        ("too many stop strings", json.dumps({**chat, "stop": [f"s{i}" for i in range(1000)]}).encode(), {}),
    ]  # fmt: skip


async def stream(client: httpx.AsyncClient, body: dict, tally: Tally, kind: str, abandon_after: int | None) -> None:
    """A streamed request; with ``abandon_after``, the client leaves after that many chunks."""
    chunks, last, done = 0, None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return tally.add(kind, "error: status", f"{response.status_code} {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                return tally.add(kind, "error: in stream", str(payload["error"]))
            if last is not None and abandon_after is None:
                tally.gaps.append(now - last)
            last, chunks = now, chunks + 1
            if abandon_after is not None and chunks >= abandon_after:
                return tally.add(kind, "abandoned")
    tally.add(kind, "served" if done else "lost", "" if done else f"stream ended after {chunks} chunks")


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, args, prompts, tally: Tally) -> None:
    user = rng.choice(prompts)
    chat = {"model": args.model, "messages": [{"role": "user", "content": user}], "max_tokens": args.max_tokens}
    if kind in ("stream", "abandon_stream"):
        body = {**chat, "stream": True}
        return await stream(client, body, tally, kind, 3 if kind == "abandon_stream" else None)
    if kind == "abandon_early":  # the client leaves before the response starts
        try:
            await client.post("/v1/chat/completions", json={**chat, "stream": True}, timeout=0.05)
        except httpx.TimeoutException:
            return tally.add(kind, "abandoned")
        return tally.add(kind, "served")
    if kind == "hostile":
        name, body, headers = rng.choice(HOSTILE)
        response = await client.post("/v1/chat/completions", content=body,
                                     headers={"content-type": "application/json", **headers})  # fmt: skip
        if 400 <= response.status_code < 500 and is_openai_error(response):
            return tally.add(kind, "refused")
        return tally.add(
            kind, "error: hostile body not refused", f"{name}: {response.status_code} {response.text[:200]}"
        )
    if kind == "long":
        text = ""
        while len(text) < 4 * args.long_tokens:  # about 4 characters a token in English and code
            text += " " + rng.choice(prompts)
        text = text[: 4 * args.long_tokens]
        body = {"model": args.model, "prompt": text, "max_tokens": 8}
    else:  # sampled
        body = {"model": args.model, "prompt": user, "max_tokens": args.max_tokens, "temperature": 0.8,
                "seed": rng.randrange(2**31)}  # fmt: skip
    response = await client.post("/v1/completions", json=body)
    if response.status_code == 200 and response.json().get("choices"):
        return tally.add(kind, "served")
    if kind == "long" and response.status_code == 400 and is_openai_error(response):
        return tally.add(kind, "refused", response.json()["error"]["message"])  # past the context: said so
    tally.add(kind, "error: status", f"{response.status_code} {response.text[:200]}")


async def worker(index: int, url: str, args, prompts, tally: Tally, deadline: float) -> None:
    rng = random.Random(args.seed * 1000 + index)
    kinds = [k for k, weight in KINDS.items() for _ in range(weight)]
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(kinds)
            try:
                await one_request(client, kind, rng, args, prompts, tally)
            except httpx.TimeoutException as err:
                tally.add(kind, "lost", f"timed out: {err!r}")
            except (httpx.HTTPError, ValueError) as err:
                tally.add(kind, "error: exception", repr(err))


async def sample(proc: psutil.Process, url: str, args, samples: list, deadline: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        start = time.monotonic()
        while time.monotonic() < deadline:
            try:
                health = await client.get("/health")
                state = health.json() if health.status_code == 200 else {}
                ok = health.status_code == 200
            except httpx.HTTPError:
                state, ok = {}, False
            samples.append({"t": round(time.monotonic() - start, 1), "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                            "health_ok": ok, "pool_entries": state.get("pool_entries")})  # fmt: skip
            await asyncio.sleep(args.sample_seconds)


def summarize(tally: Tally, samples: list, exit_code: int | None, args, seconds: float) -> dict:
    gaps = sorted(tally.gaps)
    by_kind: dict = collections.defaultdict(dict)
    for (kind, outcome), count in sorted(tally.outcomes.items()):
        by_kind[kind][outcome] = count
    errors = {o: c for (_, o), c in tally.outcomes.items() if o.startswith("error")}
    warm = [s["rss_mb"] for s in samples if s["t"] >= min(args.warmup_seconds, seconds / 3)]
    return {
        "seconds": round(seconds, 1),
        "clients": args.clients,
        "model": args.model,
        "dtype": args.dtype,
        "requests": sum(tally.outcomes.values()),
        "by_kind": by_kind,
        "errors": dict(collections.Counter({o: c for o, c in errors.items()})),
        "lost": sum(c for (_, o), c in tally.outcomes.items() if o == "lost"),
        "examples": dict(tally.examples),
        "gap_seconds": {
            "p50": round(statistics.median(gaps), 4) if gaps else None,
            "p99": round(gaps[int(0.99 * (len(gaps) - 1))], 4) if gaps else None,
            "worst": round(gaps[-1], 4) if gaps else None,
            "count": len(gaps),
        },
        "rss_mb": {
            "after_warmup": warm[0] if warm else None,
            "end": warm[-1] if warm else None,
            "max_after_warmup": max(warm) if warm else None,
        },  # fmt: skip
        "health_always_ok": all(s["health_ok"] for s in samples),
        "samples": samples,
        "exit_code": exit_code,
    }


def run(args) -> dict:
    global HOSTILE
    HOSTILE = hostile_bodies(args.model)
    prompts = [p.text for p in datasets.load("mtbench", n=40)] + [p.text for p in datasets.load("humaneval", n=40)]
    proc, url, log = start_server(args)
    tally, samples = Tally(), []
    began = time.monotonic()
    deadline = began + args.seconds

    async def main():
        jobs = [worker(i, url, args, prompts, tally, deadline) for i in range(args.clients)]
        await asyncio.gather(sample(psutil.Process(proc.pid), url, args, samples, deadline), *jobs)

    try:
        asyncio.run(main())
    finally:
        seconds = time.monotonic() - began
        exit_code = _servers.stop(proc, timeout=120)
        log.close()
    return summarize(tally, samples, exit_code, args, seconds)


def table(report: dict) -> str:
    lines = [f"soak: {report['requests']} requests in {report['seconds']} s, {report['clients']} clients, "
             f"{report['model']} ({report['dtype']})", "", "| kind | outcomes |", "|---|---|"]  # fmt: skip
    for kind, outcomes in report["by_kind"].items():
        lines.append(f"| {kind} | {', '.join(f'{o}: {c}' for o, c in outcomes.items())} |")
    gaps, rss = report["gap_seconds"], report["rss_mb"]
    lines += [
        "",
        f"lost: {report['lost']}; errors: {report['errors'] or 'none'}",
        f"stream gaps (s): p50 {gaps['p50']}, p99 {gaps['p99']}, worst {gaps['worst']} over {gaps['count']}",
        f"RSS (MB): {rss['after_warmup']} after warm-up, {rss['end']} at the end, {rss['max_after_warmup']} at most",
        f"/health always ok: {report['health_always_ok']}; exit code after SIGTERM: {report['exit_code']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1800)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--long-tokens", type=int, default=1500, help="about this many tokens per long prompt")
    parser.add_argument("--request-timeout", type=float, default=180)
    parser.add_argument("--sample-seconds", type=float, default=5)
    parser.add_argument("--warmup-seconds", type=float, default=120, help="RSS is judged after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", type=Path, help="keep the server's output (its slow-step warnings) here")
    parser.add_argument("--out", type=Path, help="write the report as JSON here (and a .md beside it)")
    parser.add_argument("server_args", nargs="*", help="after --: more options for lookahead serve")
    args = parser.parse_args(argv)
    report = run(args)
    text = table(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text + "\n")
    return 0 if report["lost"] == 0 and not report["errors"] and report["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
