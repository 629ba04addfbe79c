"""Where does a lone sequence's step time go, phase by phase, on any device? Wall time per forward
pass for transformers' greedy loop and for lookahead settings, and lookahead's step split into its
phases (drafting, planning, the forward pass, reading the choices, verification, recording,
emission, the cache commit, the rest). Each phase is timed with the device synchronised at its
ends, so that a GPU's queued work is charged to the phase that queued it; the synchronisations
cost a little, so the phases' sum runs slightly above an untimed call (also reported).

The timed call runs the same text right after the untimed one, so anything the process keeps per
shape is warm for it: on a GPU, cuDNN attention's graphs (one per new shape; see
``lookahead.attention_switch.leave_cudnn_out``). There the untimed figure is the one a fresh text meets,
and ``benchmarks/gpu_gap.py`` times steps on texts new to the process.

Prints a table of phases per setting; ``--json`` keeps every run (and, with ``--kernels``, the
top operators by device time).

    .venv/bin/python benchmarks/step_phases.py --dataset mtbench --prompt 2
    python3 benchmarks/step_phases.py --device cuda --json results/gpu/phases.json   # step 4 of gpu_check.sh
    .venv/bin/python benchmarks/step_phases.py --max-new-tokens 8 --repeats 1 --settings "(4,4,4)"  # smallest
"""

import argparse
import collections
import json
import statistics
import time

import torch
import transformers

from lookahead import Lookahead, datasets, models
from lookahead import emission as emission_module
from lookahead import engine as engine_module
from lookahead import runner as runner_module
from lookahead.drafting import TreeDrafter

SETTINGS = {  # name -> Lookahead arguments
    "Lookahead()": {},
    "Lookahead(W=0)": {"window_size": 0, "adaptive": True},  # count drafting (on CUDA the default has a window)
    "(4,4,4)": {"window_size": 4, "ngram_size": 4, "max_candidates": 4},
    "(15,5,15)": {"window_size": 15, "ngram_size": 5, "max_candidates": 15},
}


class Phases:
    """Wraps the step's parts (the library is not changed: the wrappers are removed on exit)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cuda = model.device.type == "cuda"
        self.seconds: collections.Counter = collections.Counter()
        self._undo: list = []
        self._prefilled = False

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] += time.perf_counter() - start

        self._undo.append((owner, name, inner))
        setattr(owner, name, timed)

    def __enter__(self):
        E, R = engine_module, runner_module.DecoderRunner
        for owner, name, phase in [
            (E, "draft_sources", "drafting: sources"),
            (TreeDrafter, "draft", "drafting: trie"),
            (E, "plan_tree", "planning"),
            (E, "plan_step", "planning"),
            (E.Engine, "_choose", "planning"),
            (R, "step", "forward pass (with its mask)"),
            (E, "StepChoices", "choices"),
            (E, "fetch_matched", "choices"),
            (E.Engine, "_verify", "verification"),
            (TreeDrafter, "record", "drafting: recording"),
            (emission_module.Emitter, "emit", "emission"),
            (R, "commit", "cache commit"),
            (E.Engine, "_pool_output", "pool"),
        ]:
            self.wrap(owner, name, phase)
        self.wrap(E.Engine, "step", "whole step")
        self._hooks = [  # the model's own forward, inside the forward pass phase
            self.model.register_forward_pre_hook(self._enter),
            self.model.register_forward_hook(self._leave),
        ]
        return self

    def _enter(self, *args) -> None:
        self.sync()
        self._start = time.perf_counter()

    def _leave(self, *args) -> None:
        self.sync()
        if self._prefilled:  # one generate call per context: its first forward is the prefill
            self.seconds["model forward"] += time.perf_counter() - self._start
            self.seconds["model forward calls"] += 1
        self._prefilled = True

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def timed_call(model, inputs, setting, new_tokens: int) -> tuple[float, int, object]:
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    lookahead = None
    if setting is not None:
        lookahead = Lookahead(**setting)
        kwargs["custom_generate"] = lookahead
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**inputs, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    hook.remove()
    return time.perf_counter() - start, calls[0], lookahead


def kernels(model, inputs, runs: dict, new_tokens: int) -> dict:
    """torch.profiler over one call of each run: the operators with the most device time (self),
    with their call counts per forward pass."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    sort = "self_device_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
    tables = {}
    for name, setting in runs.items():
        with profile(activities=activities) as prof:
            _, forwards, _ = timed_call(model, inputs, setting, new_tokens)
        table = prof.key_averages().table(sort_by=sort, row_limit=15)
        print(f"#### operators, {name} ({forwards} forward passes)\n```\n{table}\n```\n")
        tables[name] = table
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--prompt", type=int, default=2, help="index in the dataset's file (mtbench 2: mtbench/83)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--settings", nargs="+", default=["Lookahead()", "(4,4,4)"], choices=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernels", action="store_true", help="also torch.profiler: the top operators by device time")
    parser.add_argument("--json")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=args.device)
    prompt = datasets.load(args.dataset)[args.prompt]  # in file order
    inputs = {k: v.to(model.device) for k, v in datasets.encode(tokenizer, prompt).items()}
    runs = {"plain": None, **{name: SETTINGS[name] for name in args.settings}}
    for setting in runs.values():  # warm up (and measure a cost curve once, if none is stored)
        timed_call(model, inputs, setting, 16)
    untimed: dict[str, list[float]] = {name: [] for name in runs}
    phases: dict[str, list[dict]] = {name: [] for name in runs if runs[name] is not None}
    plain_forward: list[float] = []
    for _ in range(args.repeats):  # alternating: drift hits every run alike
        for name, setting in runs.items():
            seconds, forwards, lookahead = timed_call(model, inputs, setting, args.max_new_tokens)
            untimed[name].append(1000 * seconds / forwards)
            with Phases(model) as clock:
                seconds, forwards, lookahead = timed_call(model, inputs, setting, args.max_new_tokens)
            calls = clock.seconds.pop("model forward calls")
            if setting is None:
                plain_forward.append(1000 * clock.seconds["model forward"] / calls)
                continue
            s = lookahead.last_stats
            row = {phase: 1000 * t / s.steps for phase, t in clock.seconds.items()}
            row["model forward"] = 1000 * clock.seconds["model forward"] / calls
            row["tokens_per_step"] = s.tokens_per_step
            row["settings"] = dict(s.settings)
            phases[name].append(row)
    print(f"### Step phases: {args.model}, {args.dtype}, {args.device}, {args.dataset}/{args.prompt}, "
          f"{args.max_new_tokens} new tokens (medians of {args.repeats})\n")  # fmt: skip
    plain = statistics.median(untimed["plain"])
    print(
        f"plain greedy: {plain:.2f} ms per forward pass, of which the model's forward (timed) "
        f"{statistics.median(plain_forward):.2f} ms\n"
    )
    report = {
        "meta": vars(args) | {"torch": torch.__version__, "transformers": transformers.__version__},
        "plain_ms_per_forward": plain,
        "plain_model_forward_ms": plain_forward,
        "untimed_ms_per_forward": untimed,
        "phases": phases,
    }
    for name, rows in phases.items():
        step = statistics.median(untimed[name])
        tps = statistics.median(r["tokens_per_step"] for r in rows)
        print(f"#### {name}: {step:.2f} ms per step untimed ({step / plain:.2f}x a greedy step), "
              f"{tps:.2f} tokens per step, speed {tps * plain / step:.2f}x greedy\n")  # fmt: skip
        print("| phase | ms per step | share of the step |\n|---|---|---|")
        whole = statistics.median(r["whole step"] for r in rows)
        keys = [k for k in rows[0] if k not in ("whole step", "tokens_per_step", "settings", "model forward")]
        accounted = 0.0
        for key in sorted(keys, key=lambda k: -statistics.median(r.get(k, 0.0) for r in rows)):
            ms = statistics.median(r.get(key, 0.0) for r in rows)
            accounted += ms
            print(f"| {key} | {ms:.2f} | {ms / whole:.0%} |")
        print(f"| rest of the step | {whole - accounted:.2f} | {(whole - accounted) / whole:.0%} |")
        print(f"| **whole step (timed)** | {whole:.2f} | 100% |")
        inner = statistics.median(r["model forward"] for r in rows)
        print(f"| (of the forward pass phase: the model's forward) | {inner:.2f} | {inner / whole:.0%} |\n")
        print(f"settings (steps): {rows[0]['settings']}\n")
    if args.kernels:
        report["kernels"] = kernels(model, inputs, runs, args.max_new_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
