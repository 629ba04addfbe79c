"""A drafting policy's share of the clairvoyant bound, free of timing noise.

Each policy runs in fp32 (so every policy emits plain greedy's text, whatever steps it takes),
deciding with a given cost curve, and every forward pass is priced with that curve: modeled
speedup = (new tokens - 1) / sum over steps of T(k)/T(1), the prefill left out as the bound leaves
it out. The bound (``lookahead.bound``) is computed on the same text with the same curve, over the
text's own suffix candidates plus those the policy had at hand (``record_candidates``). So a policy
change is judged in minutes, on every cost curve of interest, with no clock involved:

    .venv/bin/python benchmarks/policy_share.py --n 10 --max-new-tokens 128 --curves stored steep flat

Curves: ``stored`` (this machine's measured bf16 curve, from ``$LOOKAHEAD_CACHE``), ``steep`` (a
slow 2-core CPU in bf16: T(k)/T(1) = 2.25, 3.0, 4.8, 7.6 for k = 2, 4, 8, 16, measured 2026-12-02),
``flat`` (a faster one: 1.23, 1.68, 1.68, 2.14, measured 2026-12-01), ``mid`` (1.44, 2.04, 3.32,
5.82, stored here 2026-12-02) and ``gpu`` (nearly free width:
1.02, 1.04, 1.08, 1.15). ``steep``, ``flat`` and ``mid`` were curves stored on other CPUs before
2026-12-04, probably timed with autograd on (the calibration had it on when `lookahead bench` asked
for a curve, until 2026-12-04), so read them as modeled machines of those shapes, not as those
machines: this one's bf16 curve without autograd was 1.03, 1.09, 1.15, 1.33 on 2026-12-04 and
1.07, 1.09, 1.12, 1.17 on 2026-12-05 (``stored``).
``stored-float16`` and ``stored-float32`` are this machine's curves in those dtypes, timed the
current way: real configurations of other shapes (here, 2026-12-05: fp16 about 1.37, 1.42, 1.6,
1.8, a dear first draft token and nearly free ones after it; fp32 about 1.08, 1.50, 1.84, 2.01).
Policies: ``auto`` (``Lookahead()``) and any named in ``POLICIES``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

from lookahead import Lookahead, assembly, costs, datasets, models
from lookahead.bound import clairvoyant_bounds
from lookahead.drafting import TreeDrafter
from lookahead.runner import DecoderRunner

CURVES = {  # T(k)/T(1) at k = 1, 2, 4, 8, 16, 32
    "steep": ((1, 1.0), (2, 2.25), (4, 3.02), (8, 4.77), (16, 7.65), (32, 14.8)),
    "flat": ((1, 1.0), (2, 1.23), (4, 1.68), (8, 1.68), (16, 2.14), (32, 4.0)),
    # this machine's stored bf16 curve of 2026-12-02 (later), between steep and flat
    "mid": ((1, 1.0), (2, 1.44), (4, 2.04), (8, 3.32), (16, 5.82), (32, 11.0)),
    "gpu": ((1, 1.0), (2, 1.02), (4, 1.04), (8, 1.08), (16, 1.15), (32, 1.3)),
}
POLICIES = {  # name -> Lookahead keyword arguments
    "auto": {},
    "chooser": {"count_drafting": False},  # one setting per step (lookahead.tuning), no count drafting
    "auto, N<=8": {"window_size": 0, "ngram_size": 8, "max_candidates": 4, "adaptive": True},
    "auto, N<=8, probes 5%": {
        "window_size": 0,
        "ngram_size": 8,
        "max_candidates": 4,
        "adaptive": True,
        "_drafter": {"probe_overhead": 0.05},
    },
    "chooser, N<=8": {
        "window_size": 0,
        "ngram_size": 8,
        "max_candidates": 4,
        "adaptive": True,
        "count_drafting": False,
    },
}


def load_curve(name: str, model_name: str) -> costs.CostCurve:
    """A named curve (``CURVES``), or ``stored`` / ``stored-DTYPE``: the curve this machine
    stored for the model in bf16 / in DTYPE (``stored-float16``, ``stored-float32``), or a JSON
    file of [tokens, seconds] points."""
    if name.endswith(".json"):
        return costs.CostCurve.from_points(json.loads(Path(name).read_text()))
    if name == "stored" or name.startswith("stored-"):
        try:
            dtype = str(models.parse_dtype(name.partition("-")[2] or "bfloat16")).replace("torch.", "")
        except ValueError as err:
            raise SystemExit(f"curve {name!r}: {err}") from None
        return stored_curve(model_name, dtype)
    if name not in CURVES:
        raise SystemExit(f"unknown curve {name!r}: one of {', '.join(CURVES)}, stored or stored-DTYPE")
    return costs.CostCurve(CURVES[name])


def stored_curve(model_name: str, dtype: str = "bfloat16") -> costs.CostCurve:
    """The curve ``Lookahead()`` stored for the model in ``dtype`` on this machine, timed the
    current way (``costs.CALIBRATION``), at this process's thread count where one was stored at
    it; any run of the model in that dtype stores one (``lookahead bench --dtype ...``)."""
    hint = f"run `lookahead bench humaneval --n 1 --max-new-tokens 8 --model {model_name} --dtype {dtype}` once"
    try:
        stored = json.loads((models.cache_dir() / "cost-curves.json").read_text())
    except FileNotFoundError:
        raise SystemExit(f"no cost curve stored yet in {models.cache_dir()}: {hint}") from None
    arch = {"smollm2": "llama", "gemma3": "gemma3_text"}.get(model_name, model_name)
    mine = f"|{dtype}|", costs.CALIBRATION
    # the model's, not the tiny test models' of the same architecture (their T(1) is under 20 ms)
    keys = [k for k in stored if k.startswith(arch + "-") and all(m in k.replace("torch.", "") for m in mine)]
    keys = [k for k in keys if stored[k][0][1] > 0.02]
    if not keys:
        raise SystemExit(f"no {dtype} cost curve of {model_name} stored: {hint}")
    threads = [k for k in keys if f"|{torch.get_num_threads()}|" in k]
    if not threads:
        print(f"note: no {dtype} curve at {torch.get_num_threads()} threads; using {keys[0]}", file=sys.stderr)
    return costs.CostCurve(tuple((int(k), float(s)) for k, s in stored[(threads or keys)[0]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--curves", nargs="+", default=["stored", "steep", "flat"])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype="float32")
    priced = [0.0]
    curve_now: list[costs.CostCurve] = []
    step = DecoderRunner.step

    def timed_step(self, layout, step_ids):  # price every forward pass with the curve in use
        priced[0] += curve_now[0].ratio(layout.length, len(step_ids))
        return step(self, layout, step_ids)

    DecoderRunner.step = timed_step
    rows = []
    print("| curve | dataset | policy | modeled speedup (median) | bound, cap 7 (median) | share | bound, cap 3 | "
          "share | tokens/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for curve_name in args.curves:
        curve = load_curve(curve_name, args.model)
        curve_now[:] = [curve]
        for name in args.datasets:
            prompts = datasets.load(name, args.n)
            runs = {p: [] for p in args.policies}
            reference = None
            # one instance per policy and dataset, reused prompt after prompt as a workload would
            # reuse it (it carries its drafter's statistics from call to call)
            instances = {}
            for policy in args.policies:
                options = dict(POLICIES[policy])
                options.pop("_drafter", None)
                instances[policy] = Lookahead(**options, cost_curve=curve, record_candidates=True)
            for prompt in prompts:
                inputs = datasets.encode(tokenizer, prompt)
                for policy in args.policies:
                    drafter_options = POLICIES[policy].get("_drafter", {})  # TreeDrafter settings to try
                    assembly.TreeDrafter = functools.partial(TreeDrafter, **drafter_options)
                    la = instances[policy]
                    priced[0] = 0.0
                    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                         custom_generate=la)  # fmt: skip
                    ids = inputs["input_ids"][0].tolist()
                    output = out[0, len(ids) :].tolist()
                    if reference is None or policy == args.policies[0]:
                        reference = output
                    assert output == reference, "policies must emit the same (greedy, fp32) text"
                    stats = la.last_stats
                    bounds = clairvoyant_bounds(ids, output, curve, caps=(7, 3), extra=la.last_candidates[0])
                    speedup = (len(output) - 1) / priced[0] if priced[0] else 1.0
                    runs[policy].append((speedup, bounds[7].speedup, bounds[3].speedup, stats.tokens_per_step))
                    rows.append({"curve": curve_name, "dataset": name, "policy": policy, "prompt": prompt.id,
                                 "speedup": speedup, "bound7": bounds[7].speedup, "bound3": bounds[3].speedup,
                                 "tokens_per_step": stats.tokens_per_step, "settings": stats.settings})  # fmt: skip
            for policy, results in runs.items():
                speed = statistics.median(r[0] for r in results)
                b7, b3 = statistics.median(r[1] for r in results), statistics.median(r[2] for r in results)
                tps = statistics.mean(r[3] for r in results)
                print(f"| {curve_name} | {name} | {policy} | {speed:.3f}x | {b7:.3f}x | {speed / b7:.0%} | {b3:.3f}x | "
                      f"{speed / b3:.0%} | {tps:.2f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
