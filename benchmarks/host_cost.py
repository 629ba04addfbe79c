"""The loop's own time per step: wall time minus the time spent inside the model's forward pass,
divided by forward passes, for transformers' plain greedy loop and for lookahead settings, at
batch 1 and batch 8 (issue 13's measure). Runs alternate within one process; medians of
``--repeats`` runs.

The forward pass is timed by hooks on the model (on CUDA they synchronise the device, so the
GPU's work counts as forward time). ``--layers 2`` keeps the first two decoder layers of the model
(same vocabulary, a cheap forward pass): there the loop's own work shows.

    .venv/bin/python benchmarks/host_cost.py --layers 2 --batch 1 8
    .venv/bin/python benchmarks/host_cost.py --batch 1 --json results/host-cost.json
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from lookahead import Lookahead, datasets, engine, models

SETTINGS = {  # name -> Lookahead arguments (None: transformers' plain greedy loop)
    "plain": None,
    "Lookahead()": (),
    "(4,4,4)": (4, 4, 4),
    "(7,4,7)": (7, 4, 7),
    "(15,5,15)": (15, 5, 15),
}


class ForwardClock:
    """Seconds spent inside ``model.forward`` and how many calls, via forward hooks."""

    def __init__(self, model) -> None:
        self.seconds, self.calls, self._start = 0.0, 0, 0.0
        self.cuda = model.device.type == "cuda"
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _enter(self, module, args) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class ChoiceClock:
    """Seconds spent reading the model's greedy choices over a step's kept slots (an argmax over
    [B, K, V]: host work on a CPU, one kernel on a GPU), by wrapping ``engine.greedy_choices``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        inner = engine.greedy_choices

        def timed(logits):
            start = time.perf_counter()
            out = inner(logits)
            self.seconds += time.perf_counter() - start
            return out

        engine.greedy_choices = timed


def run(model, inputs, setting, max_new_tokens: int, clock: ForwardClock, choices: ChoiceClock) -> dict:
    clock.reset()
    choices.seconds = 0.0
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if setting is not None:
        kwargs["custom_generate"] = Lookahead(*setting)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    new = int((out[:, inputs["input_ids"].shape[1] :] != -1).sum())
    return {
        "host_ms_per_step": 1000 * (wall - clock.seconds) / clock.calls,
        "forward_ms_per_step": 1000 * clock.seconds / clock.calls,
        "choices_ms_per_step": 1000 * choices.seconds / clock.calls,
        "steps": clock.calls,
        "tokens": new,
        "wall_s": wall,
    }


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
    clock, choices = ForwardClock(model), ChoiceClock()
    prompts = datasets.load("humaneval", max(args.batch))
    results = []
    for batch in args.batch:
        if batch == 1:
            inputs = datasets.encode(tokenizer, prompts[0])
        else:
            inputs = datasets.encode_batch(tokenizer, prompts[:batch])
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        for name in args.settings:  # warm up (and measure a cost curve once, if none is stored)
            run(model, inputs, SETTINGS[name], 8, clock, choices)
        samples: dict[str, list[dict]] = {name: [] for name in args.settings}
        for _ in range(args.repeats):
            for name in args.settings:  # alternating, so that drifts hit every setting alike
                samples[name].append(run(model, inputs, SETTINGS[name], args.max_new_tokens, clock, choices))
        plain = statistics.median(r["host_ms_per_step"] for r in samples.get("plain", [])) if "plain" in samples else None
        print(f"\n## batch {batch}: host ms per forward pass (median of {args.repeats})")
        print("| run | host ms/step | above plain | of which greedy choices | forward ms/step | steps | tokens |")
        print("|---|---|---|---|---|---|---|")
        for name, runs in samples.items():
            host = statistics.median(r["host_ms_per_step"] for r in runs)
            fwd = statistics.median(r["forward_ms_per_step"] for r in runs)
            argmax = statistics.median(r["choices_ms_per_step"] for r in runs)
            above = f"{host - plain:+.2f}" if plain is not None else "-"
            steps = statistics.median(r["steps"] for r in runs)
            print(f"| {name} | {host:.2f} | {above} | {argmax:.2f} | {fwd:.2f} | {steps:.0f} | {runs[0]['tokens']} |")
            results.append({"batch": batch, "run": name, "host_ms_per_step": host, "forward_ms_per_step": fwd, "choices_ms_per_step": argmax,
                            "above_plain_ms": None if plain is None else host - plain, "runs": runs})  # fmt: skip
    if args.json:
        meta = {"model": args.model, "dtype": args.dtype, "device": args.device, "layers": args.layers,
                "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
