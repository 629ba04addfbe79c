"""Why does a lookahead step cost more than the cost curve says on a GPU host? The suspects, one at a time.

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
* ``cuDNN in wide steps``: the loop as before 2026-12-04 (later), when steps with a mask of their
  own ran on PyTorch's preferred attention backend, cuDNN on Hopper, which builds an execution
  graph per new shape (``lookahead.attention_switch.leave_cudnn_out``, the suspect chosen on 2026-12-04 from
  PyTorch's issues, not from a timing);
* ``no cuDNN``: cuDNN attention off for the whole call, greedy's steps too (a new cache length is
  a new shape for greedy as well, but greedy meets each length again on later prompts);

and then the bare forward pass of the runner at a real context, for 1 and 64 new tokens: the same
shape again and again, the way the curve times it (synchronised) and back to back, and a new shape
each pass (the cache growing by one), with and without cuDNN attention.

Every timed call runs a prompt of its own (``--first`` on), so that the shapes it meets are
mostly new to the process, as in the bench: cuDNN keeps the graph of every shape it has seen, and
a second call on the same text would find them all built. As in the bench, greedy runs first on
each prompt (so ``Lookahead()``'s steps of t alone, which have greedy's shapes, find theirs
built), and cache lengths overlap from prompt to prompt. Prints both tables; ``--json`` keeps
every timing.

    python3 benchmarks/gpu_gap.py --device cuda --json results/gpu/gap.json    # step 2 of gpu_check.sh
    .venv/bin/python benchmarks/gpu_gap.py --device cpu --max-new-tokens 16 --rounds 1   # tries it
    .venv/bin/python benchmarks/gpu_gap.py --device cpu --max-new-tokens 8 --rounds 1 --variants default \\
        --bare-passes 2                                                         # smallest: seconds
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
from lookahead import runner as runner_module
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
    rule, cudnn = runner_module.leave_cudnn_out, torch.backends.cuda.cudnn_sdp_enabled()
    if name == "threads=1":
        torch.set_num_threads(1)
    elif name == "sync":
        hook = model.register_forward_hook(lambda *_: sync(model.device))
    elif name == "gc off":
        gc.disable()
    elif name == "cuDNN in wide steps":
        runner_module.leave_cudnn_out = lambda: False
    elif name == "no cuDNN":
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if hook is not None:
            hook.remove()
        if collecting:
            gc.enable()
        runner_module.leave_cudnn_out = rule
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


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
    """ms per forward pass of the runner after ``ids``, for 1 and 64 new tokens: the same shape
    again and again, synchronised after each pass (as the curve is timed) and back to back; a new
    shape each pass (t's entry kept, so the cache grows by one, as in a call; back to back); and,
    for 64 tokens,
    that again with cuDNN attention allowed (the loop before it was left out of such steps)."""
    spec = check_model(model)
    results = {}
    modes = ("same shape, synchronised", "same shape, back to back", "new shape each pass")
    for k in (1, 64):
        layout = build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1)
        step_ids = [[ids[-1]] * k]
        for mode in (*modes, "new shape each pass, cuDNN allowed") if k > 1 else modes:
            runner = DecoderRunner(model, spec)  # a fresh cache each time: every mode starts after ids
            runner.prefill([ids])
            if "cuDNN allowed" in mode:
                runner.masked_attention = contextlib.nullcontext()
            grows = mode.startswith("new shape")
            runner.step(layout, step_ids)  # warm-up
            runner.cache.crop(-k)
            sync(model.device)
            start = time.perf_counter()
            for _ in range(reps):
                runner.step(layout, step_ids)
                if mode.endswith("synchronised"):
                    sync(model.device)
                if grows:  # t's entry stays: the next pass sees one more column, a new shape
                    runner.commit(layout, [(None, 1)])
                else:
                    runner.cache.crop(-k)
            sync(model.device)
            results[f"{k} tokens, {mode}"] = 1000 * (time.perf_counter() - start) / reps
    return results


@torch.no_grad()  # as generate runs: autograd would time (and keep) a graph per pass
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument(
        "--first", type=int, default=10, help="the first prompt's index in the dataset's file; each call takes the next"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="each variant timed this many times, alternating")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default", "cuDNN in wide steps", "no cuDNN", "threads=1", "sync", "gc off"],
    )
    parser.add_argument("--bare-passes", type=int, default=20, help="timed passes per shape of the bare pass")
    parser.add_argument("--json")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=args.device)
    calls = args.rounds * len(args.variants)
    prompts = datasets.load(args.dataset)[args.first : args.first + calls + 1]  # in file order
    if len(prompts) < calls + 1:
        raise SystemExit(f"{args.dataset} has too few prompts from {args.first} for {calls} calls")
    encoded = [{k: v.to(model.device) for k, v in datasets.encode(tokenizer, p).items()} for p in prompts]
    new = args.max_new_tokens
    la = Lookahead()
    methods = ((None, "greedy"), (la, "Lookahead()"))
    for name in args.variants:  # first calls pay one-time costs (the probe; a curve per thread count)
        for method, _ in methods:
            with variant(name, model):
                call(model, encoded[-1], 8, method)
    # a prompt per (round, variant), both methods on it: shapes a call meets are new to the process,
    # as in the bench, where cuDNN's graphs kept from an earlier call of the same text would hide them
    timings = {(v, m): [] for v in args.variants for _, m in methods}
    passes = {(v, m): [0, 0] for v in args.variants for _, m in methods}  # forward passes, new tokens
    for r in range(args.rounds):
        for i, name in enumerate(args.variants):
            inputs = encoded[r * len(args.variants) + i]
            for method, label in methods:
                with variant(name, model):
                    seconds, steps, tokens = call(model, inputs, new, method)
                timings[name, label].append(1000 * seconds / steps)
                passes[name, label][0] += steps
                passes[name, label][1] += tokens
    ids = [p.id for p in prompts[:calls]]
    print(f"### {args.dataset} {ids[0]}..{ids[-1]}, {args.dtype}, {model.device}, {new} new tokens, "
          f"{torch.get_num_threads()} threads\n")  # fmt: skip
    print("| variant | greedy ms per pass | Lookahead() ms per pass | Lookahead() tokens per pass |")
    print("|---|---|---|---|")
    report = {"prompts": ids, "device": str(model.device), "threads": torch.get_num_threads(), "variants": {}}
    for name in args.variants:
        greedy = statistics.median(timings[name, "greedy"])
        mine = statistics.median(timings[name, "Lookahead()"])
        steps, tokens = passes[name, "Lookahead()"]
        print(f"| {name} | {greedy:.2f} | {mine:.2f} | {tokens / steps:.2f} |")
        report["variants"][name] = {
            "greedy_ms": timings[name, "greedy"],
            "lookahead_ms": timings[name, "Lookahead()"],
            "lookahead_passes_tokens": passes[name, "Lookahead()"],
        }
    ids = encoded[-1]["input_ids"][0].tolist()
    ids = ids + [ids[-1]] * min(new, 256)  # the context a step sees late in the call
    bare = bare_passes(model, ids, reps=args.bare_passes)
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
