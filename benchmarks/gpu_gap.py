"""Why a lookahead step costs more than the cost curve says on a GPU host: the suspects, one at a time.

On the H200 of 2026-12-04 (second run) every `Lookahead()` step took 105-132 ms while the cost
curve, timed with the device synchronised after each pass at a 64-token context, said 42-53 ms
for 1-128 new tokens; transformers' greedy loop took 34-116 ms per token in the same process,
falling over the run. The first run saw the same gap between an untimed step (43.7 ms) and its
phases timed with synchronisations (23.9 ms). This probe times, in one process and alternating,
one prompt's call under each variant, so that the suspect whose removal closes the gap shows:

* ``default``: as the bench runs it;
* ``threads=1``: ``torch.set_num_threads(1)`` (the loop does some host tensor work per step,
  greedy none; 16 threads on that host);
* ``sync``: the device synchronised after every forward pass (a forward hook), as the curve's
  timing does;
* ``gc off``: Python's garbage collector disabled during the call;

and then the bare forward pass of the runner at the prompt's real context, the way the curve times
it (synchronised) and back to back without synchronising, for 1 and 64 new tokens, with the
layout reused or rebuilt on every pass (a rebuilt layout copies its mask, positions and slots to
the device again, as drafted trees of new shapes do).

    python3 benchmarks/gpu_gap.py --device cuda --json results/gpu/gap.json
    .venv/bin/python benchmarks/gpu_gap.py --device cpu --max-new-tokens 16   # tries the script
"""

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
import transformers

from lookahead import Lookahead, datasets, models
from lookahead.layout import build_layout
from lookahead.runner import DecoderRunner
from lookahead.support import check_model


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@contextlib.contextmanager
def variant(name: str, model):
    """The conditions of one variant, undone on exit."""
    threads, hook, collecting = torch.get_num_threads(), None, gc.isenabled()
    if name == "threads=1":
        torch.set_num_threads(1)
    elif name == "sync":
        hook = model.register_forward_hook(lambda *_: sync(model.device))
    elif name == "gc off":
        gc.disable()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if hook is not None:
            hook.remove()
        if collecting:
            gc.enable()


def call(model, inputs: dict, new: int, la: Lookahead | None) -> tuple[float, int, int]:
    """(seconds, forward passes, new tokens) of one generate call."""
    kwargs = {"custom_generate": la} if la is not None else {}
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new, do_sample=False, **kwargs)
    sync(model.device)
    seconds = time.perf_counter() - start
    tokens = out.shape[1] - inputs["input_ids"].shape[1]
    return seconds, la.last_stats.steps if la is not None else tokens, tokens


def bare_passes(model, ids: list[int], reps: int) -> dict:
    """ms per forward pass of the runner after ``ids``, for 1 and 64 new tokens: synchronised after
    each pass (as the curve), back to back (synchronised once at the end), and back to back with
    the layout's device tensors made again each pass."""
    spec = check_model(model)
    runner = DecoderRunner(model, spec)
    runner.prefill([ids])
    results = {}
    for k in (1, 64):
        layout = build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1)
        step_ids = [[ids[-1]] * k]
        for mode in ("synchronised", "back to back", "layout made again"):
            runner.step(layout, step_ids)  # warm-up
            runner.cache.crop(-k)
            sync(model.device)
            start = time.perf_counter()
            for _ in range(reps):
                if mode == "layout made again":
                    layout._derived.clear()
                runner.step(layout, step_ids)
                if mode == "synchronised":
                    sync(model.device)
                runner.cache.crop(-k)
            sync(model.device)
            results[f"{k} tokens, {mode}"] = 1000 * (time.perf_counter() - start) / reps
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--prompt", type=int, default=3, help="index in the dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="each variant timed this many times, alternating")
    parser.add_argument("--variants", nargs="+", default=["default", "threads=1", "sync", "gc off"])
    parser.add_argument("--json")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=args.device)
    prompt = datasets.load(args.dataset, args.prompt + 1)[args.prompt]
    inputs = {k: v.to(model.device) for k, v in datasets.encode(tokenizer, prompt).items()}
    new = args.max_new_tokens
    la = Lookahead()
    methods = ((None, "greedy"), (la, "Lookahead()"))
    for name in args.variants:  # first calls pay one-time costs (the probe; a curve per thread count)
        for method, _ in methods:
            with variant(name, model):
                call(model, inputs, 8, method)
    timings = {(v, m): [] for v in args.variants for _, m in methods}
    passes = {}  # (variant, method) -> (forward passes, new tokens) of the last call
    for _ in range(args.rounds):
        for name in args.variants:
            for method, label in methods:
                with variant(name, model):
                    seconds, *passes[name, label] = call(model, inputs, new, method)
                timings[name, label].append(1000 * seconds / passes[name, label][0])
    print(f"### {prompt.id}, {args.dtype}, {model.device}, {new} new tokens, {torch.get_num_threads()} threads\n")
    print("| variant | greedy ms per pass | Lookahead() ms per pass | Lookahead() passes | speed vs greedy |")
    print("|---|---|---|---|---|")
    report = {"prompt": prompt.id, "device": str(model.device), "threads": torch.get_num_threads(), "variants": {}}
    for name in args.variants:
        greedy = statistics.median(timings[name, "greedy"])
        mine = statistics.median(timings[name, "Lookahead()"])
        (plain, _), (steps, _) = passes[name, "greedy"], passes[name, "Lookahead()"]
        print(f"| {name} | {greedy:.2f} | {mine:.2f} | {steps} | {greedy * plain / (mine * steps):.2f}x |")
        report["variants"][name] = {
            "greedy_ms": timings[name, "greedy"],
            "lookahead_ms": timings[name, "Lookahead()"],
            "lookahead_passes": steps,
            "greedy_passes": plain,
        }
    ids = inputs["input_ids"][0].tolist()
    ids = ids + [ids[-1]] * min(new, 256)  # the context a step sees late in the call
    bare = bare_passes(model, ids, reps=20)
    print(f"\nthe runner's bare forward pass after {len(ids)} tokens, ms:\n")
    print("| pass | ms |\n|---|---|")
    for name, ms in bare.items():
        print(f"| {name} | {ms:.2f} |")
    report["bare_passes_ms"] = bare
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
