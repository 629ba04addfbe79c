"""What does running torch's CPU work on more than one thread cost? Time per token of plain greedy
decoding on the thread that loaded the model, on another thread, and through `lookahead.service`.

On a CPU, torch's OpenMP runtime (GNU libgomp) keeps a team of worker threads for every thread
that has run parallel work; while a process holds more of those workers than it has CPUs, libgomp
stops spin-waiting between parallel regions and puts its workers to sleep, so every forward pass
pays for waking them. A model loaded on one thread and run on another is then slower on both
threads. `lookahead serve` therefore loads its model on the engine thread, which then runs every
forward pass (`Service(load, ...)`). The order below matters: a thread that has run parallel work
keeps its team until it exits, so the measurements without the main thread's team come first.
Prints ms per token for each placement (median of ``--repeats``).

    .venv/bin/python benchmarks/thread_cost.py                                  # docs/serving.md
    .venv/bin/python benchmarks/thread_cost.py --new-tokens 8 --repeats 1       # smallest: seconds
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from engine_load import drive  # benchmarks/, on the path when this script runs

    from lookahead import datasets, models
    from lookahead.service import PLAIN_CONFIG, Service

    n = args.new_tokens
    rows: dict[str, list[float]] = {}

    def prompt(tokenizer) -> torch.Tensor:
        return datasets.encode(tokenizer, datasets.load("humaneval", 1)[0])["input_ids"]

    def generate_ms(model, ids) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return (time.perf_counter() - start) / n * 1000

    def service_ms(service: Service, ids: list[int]) -> float:
        seconds, outputs = asyncio.run(drive(service, [ids], 1, n))
        return seconds / len(outputs[0]) * 1000

    def timed(name: str, measure) -> None:
        measure()  # warm-up
        rows[name] = [measure() for _ in range(args.repeats)]

    # 1. nothing on the main thread yet: a service whose engine thread loaded the model
    loaded = {}

    def load():
        loaded["model"], loaded["tokenizer"] = models.load(args.model, dtype=args.dtype)
        return loaded["model"]

    service = Service(load, PLAIN_CONFIG)
    ids = prompt(loaded["tokenizer"])[0].tolist()
    timed("service, model loaded on its engine thread", lambda: service_ms(service, ids))
    service.shutdown()
    del loaded["model"]

    # 2. the main thread loads the model: from now on it holds a team of its own
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    ids_tensor = prompt(tokenizer)
    timed("generate on the thread that loaded the model", lambda: generate_ms(model, ids_tensor))
    service = Service(model, PLAIN_CONFIG)
    timed("service, model loaded on the main thread", lambda: service_ms(service, ids))
    service.shutdown()
    result: list[float] = []

    def other_thread() -> float:
        worker = threading.Thread(target=lambda: result.append(generate_ms(model, ids_tensor)))
        worker.start()
        worker.join()
        return result.pop()

    timed("generate on another thread", other_thread)
    timed("generate on the thread that loaded the model, again", lambda: generate_ms(model, ids_tensor))

    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, {n} new tokens, medians of {args.repeats}")
    print("| where | ms per token (median) | runs |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
