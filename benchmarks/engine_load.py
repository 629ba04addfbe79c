"""How fast does the server's engine serve concurrent clients with lookahead, against plain
one-token steps, without HTTP in the way?

``benchmarks/serve_load.py`` measures what clients see, through uvicorn and the openai client;
this drives the same :class:`lookahead.service.Service` (engine thread, continuous batching,
measured batch costs, warm pool) in-process, so that a change to the engine or the tuner can be
judged in a few minutes and with less noise. C clients each send their share of the requests one
after another (greedy, ``max_tokens`` each); every repeat builds fresh services (an empty warm
pool, no drafting statistics), and the servers run one after the other on the same requests.
Prints output tokens/s per server (median over repeats), its ratio to plain, forward passes, the
steps that were wide and how many outputs were plain's; ``--out`` keeps every row as JSON. In
fp32 every server must return plain's tokens: the exit status is 1 if one did not.

    .venv/bin/python benchmarks/engine_load.py --dataset mtbench --clients 8 --requests 8   # docs/serving.md
    .venv/bin/python benchmarks/engine_load.py --dtype float32 --max-tokens 64 --clients 16 --requests 16
    .venv/bin/python benchmarks/engine_load.py --clients 2 --requests 2 --max-tokens 8 --repeats 1  # smallest
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

import torch

from lookahead import datasets, models
from lookahead.config import LookaheadConfig
from lookahead.decoding import Lookahead
from lookahead.pool import SharedPool
from lookahead.service import PLAIN_CONFIG, Request, Service


def services(model, lookahead: LookaheadConfig, max_batch_size: int) -> dict:
    """Each server as a function that starts it: one service at a time holds an engine thread (a
    second thread with torch work of its own would slow both, see benchmarks/thread_cost.py)."""
    return {
        "plain": lambda: Service(model, PLAIN_CONFIG, max_batch_size=max_batch_size),
        "lookahead": lambda: Service(model, lookahead, max_batch_size=max_batch_size, shared_pool=SharedPool()),
        "lookahead, no shared pool": lambda: Service(model, lookahead, max_batch_size=max_batch_size),
    }


def load_apart(name: str, dtype: str):
    """The model and tokenizer, loaded on a thread that exits once done, so that the main thread
    holds no torch worker team of its own while the services' engine threads run."""
    loaded = []
    worker = threading.Thread(target=lambda: loaded.append(models.load(name, dtype=dtype)))
    worker.start()
    worker.join()
    if not loaded:
        raise SystemExit(f"could not load {name}")
    return loaded[0]


async def drive(service: Service, prompts: list[list[int]], clients: int, max_tokens: int) -> tuple[float, list]:
    queue = list(enumerate(prompts))
    outputs: list = [None] * len(prompts)

    async def client():
        while queue:
            index, ids = queue.pop(0)
            request = Request(ids, max_tokens)
            service.submit(request)
            tokens = []
            while True:
                event = await request.events.get()
                tokens += event.tokens
                if event.finish_reason is not None:
                    break
            outputs[index] = tokens

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="mtbench", help="humaneval | mtbench | FILE.jsonl")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    model, tokenizer = load_apart(args.model, args.dtype)
    prompts = [
        datasets.encode(tokenizer, p)["input_ids"][0].tolist() for p in datasets.load(args.dataset, args.requests)
    ]
    cfg = Lookahead().config_for(model.device)
    rows, reference = [], None
    for repeat in range(args.repeats):
        for name, start in services(model, cfg, args.max_batch_size).items():
            service = start()
            seconds, outputs = asyncio.run(drive(service, prompts, args.clients, args.max_tokens))
            service.shutdown()
            tokens = sum(len(o) for o in outputs)
            reference = reference or outputs
            rows.append(
                {
                    "repeat": repeat,
                    "server": name,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "forward_passes": service.stats.steps,  # a fresh service: this run's alone
                    "wide_steps": service.engine.chooser.wide_steps,
                    "same_as_plain": sum(o == r for o, r in zip(outputs, reference, strict=True)),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    plain = {r["repeat"]: r["tokens_per_s"] for r in rows if r["server"] == "plain"}
    print(f"{args.dataset}, {args.clients} clients, {args.requests} requests x {args.max_tokens} tokens, "
          f"batch <= {args.max_batch_size}, {args.dtype}, {torch.get_num_threads()} threads")  # fmt: skip
    print("| server | tok/s (median) | vs plain (median of repeats) | forward passes | wide steps | outputs (fewest) |")
    print("|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        ratio = statistics.median(r["tokens_per_s"] / plain[r["repeat"]] for r in mine)
        same = f"{min(r['same_as_plain'] for r in mine)}/{len(prompts)} identical"
        print(
            f"| {name} | {statistics.median(r['tokens_per_s'] for r in mine):.1f} | {ratio:.2f}x | "
            f"{statistics.median(r['forward_passes'] for r in mine):.0f} | "
            f"{statistics.median(r['wide_steps'] for r in mine):.0f} | {same} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    exact = all(r["same_as_plain"] == len(prompts) for r in rows)
    return 0 if exact or args.dtype != "float32" else 1  # fp32 must match token for token


if __name__ == "__main__":
    sys.exit(main())
