"""How much host time does the loop add per step? Wall time minus the time spent inside the
model's forward pass, divided by forward passes, for transformers' plain greedy loop and for
lookahead settings, at batch 1 and batch 8 (issue 13's measure). Runs alternate within one
process; medians of ``--repeats`` runs.

The forward pass is timed by hooks on the model (on CUDA they synchronise the device, so the
GPU's work counts as forward time). ``--layers 2`` keeps the first two decoder layers of the model
(same vocabulary, a cheap forward pass): there the loop's own work shows.

Two parts of the host time grow with the kept logits (slots x vocabulary) and are shown apart:
the greedy choices (an argmax over them: on a CPU the host's work, on a GPU one kernel) and
freeing them (on a CPU, tens of MB handed back to the OS every step; on a GPU the caching
allocator keeps them). What is left is the loop's own work: Python, pools, masks, the cache.
Prints a table per batch size; ``--json`` keeps every run.

    .venv/bin/python benchmarks/host_cost.py --layers 2 --batch 1 8 --max-new-tokens 64 --repeats 5 # how-it-works.md
    .venv/bin/python benchmarks/host_cost.py --layers 1 --batch 1 2 --max-new-tokens 8 --repeats 1 \\
        --settings plain "Lookahead()"                                          # smallest: seconds
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from lookahead import Lookahead, datasets, models
from lookahead import choices as choice_module

SETTINGS = {  # name -> Lookahead arguments (None: transformers' plain greedy loop)
    "plain": None,
    "Lookahead()": (),
    "(4,4,4)": (4, 4, 4),
    "(7,4,7)": (7, 4, 7),
    "(15,5,15)": (15, 5, 15),
}


class ForwardClock:
    """Seconds spent inside ``model.forward`` and how many calls, via forward hooks; and the
    seconds spent freeing each call's output (held here until the next call, whose pre-hook
    times its release: by then the loop has let go of it)."""

    def __init__(self, model) -> None:
        self.seconds, self.calls, self._start = 0.0, 0, 0.0
        self.free_seconds, self._output = 0.0, None
        self.cuda = model.device.type == "cuda"
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _enter(self, module, args) -> None:
        self.release()
        self._sync()
        self._start = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start
        self.calls += 1
        self._output = output

    def release(self) -> None:
        start = time.perf_counter()
        self._output = None
        self.free_seconds += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds, self.calls, self.free_seconds, self._output = 0.0, 0, 0.0, None


class ChoiceClock:
    """Seconds spent computing the model's greedy choices over a step's kept slots (an argmax over
    [B, K, V]: host work on a CPU, one kernel on a GPU), by wrapping ``choices.greedy_choices``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        inner = choice_module.greedy_choices

        def timed(logits, *args):
            start = time.perf_counter()
            out = inner(logits, *args)
            self.seconds += time.perf_counter() - start
            return out

        choice_module.greedy_choices = timed


def run(model, inputs, setting, max_new_tokens: int, clock: ForwardClock, argmax: ChoiceClock) -> dict:
    clock.reset()
    argmax.seconds = 0.0
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if setting is not None:
        kwargs["custom_generate"] = Lookahead(*setting)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs)
    clock.release()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    host = wall - clock.seconds  # the time spent freeing outputs is the host's too
    per_step = lambda seconds: 1000 * seconds / clock.calls
    return {
        "host_ms_per_step": per_step(host),
        "forward_ms_per_step": per_step(clock.seconds),
        "choices_ms_per_step": per_step(argmax.seconds),
        "free_ms_per_step": per_step(clock.free_seconds),
        "loop_ms_per_step": per_step(host - argmax.seconds - clock.free_seconds),
        "steps": clock.calls,
        "tokens": int(out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1])),
        "wall_s": wall,
    }


def report(batch: int, samples: dict[str, list[dict]], repeats: int) -> list[dict]:
    """Print the medians of each setting's runs as a table; return them."""

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in samples[name])

    plain = median("plain", "host_ms_per_step") if "plain" in samples else None
    signed = lambda v: "-" if v is None else f"{v:+.2f}"
    print(f"\n## batch {batch}: host ms per forward pass (median of {repeats})")
    print("| run | host | above plain | greedy choices | freeing logits | loop's own | loop's own above plain "
          "| forward | steps | tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, runs in samples.items():
        row = {k: median(name, k) for k in runs[0] if k.endswith("_per_step") or k == "steps"}
        for part in ("host", "loop"):
            row[f"{part}_above_plain_ms"] = None if plain is None else row[f"{part}_ms_per_step"] - plain
        print(f"| {name} | {row['host_ms_per_step']:.2f} | {signed(row['host_above_plain_ms'])} "
              f"| {row['choices_ms_per_step']:.2f} | {row['free_ms_per_step']:.2f} | {row['loop_ms_per_step']:.2f} "
              f"| {signed(row['loop_above_plain_ms'])} | {row['forward_ms_per_step']:.2f} | {row['steps']:.0f} "
              f"| {runs[0]['tokens']} |")  # fmt: skip
        rows.append({"batch": batch, "run": name, **row, "runs": runs})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, help="keep only the first LAYERS decoder layers")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=args.device)
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: args.layers]
    clock, argmax = ForwardClock(model), ChoiceClock()
    prompts = datasets.load("humaneval", max(args.batch))
    results = []
    for batch in args.batch:
        if batch == 1:
            inputs = datasets.encode(tokenizer, prompts[0])
        else:
            inputs = datasets.encode_batch(tokenizer, prompts[:batch])
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        for name in args.settings:  # warm up (and measure a cost curve once, if none is stored)
            run(model, inputs, SETTINGS[name], 8, clock, argmax)
        samples: dict[str, list[dict]] = {name: [] for name in args.settings}
        for _ in range(args.repeats):
            for name in args.settings:  # alternating, so that drifts hit every setting alike
                samples[name].append(run(model, inputs, SETTINGS[name], args.max_new_tokens, clock, argmax))
        results += report(batch, samples, args.repeats)
    if args.json:
        meta = {"model": args.model, "dtype": args.dtype, "device": args.device, "layers": args.layers,
                "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
