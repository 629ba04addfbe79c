"""Is lookahead exact on a CUDA device, how often does a step make the host wait for the device,
and what is the device's cost curve? What benchmarks/gpu_check.sh checks besides speed.

    python3 benchmarks/gpu_checks.py --json results/gpu/checks.json             # step 1 of gpu_check.sh
    .venv/bin/python benchmarks/gpu_checks.py --device cpu --n 1 --new-tokens 8  # smallest: tries it on a CPU

1. **Exactness** (fp32): ``Lookahead()`` (on CUDA: count drafting with the Jacobi window),
   ``Lookahead(window_size=0, adaptive=True)`` (count drafting alone, the CPU default), (4, 4, 4)
   and (15, 5, 15) against ``model.generate`` greedy on a few HumanEval and MT-bench prompts,
   alone and as a left-padded batch of 4.
2. **Synchronisations** (bf16): ``torch.cuda.set_sync_debug_mode("warn")`` reports every call
   that makes the host wait for the device; counted per forward pass, for greedy steps at batch
   1 and 4 (the target: one per step, the read of the chosen tokens).
3. **Cost curve** (bf16): T(k) / T(1) for k = 1 .. 128 new tokens, as the tuner measures it.

Prints each result as it comes; ``--json`` keeps them all. On a CPU there are no synchronisations
to count: the other two checks run.
"""

import argparse
import json
import time
import warnings
from collections import Counter

import torch
import transformers

from lookahead import Lookahead, datasets, models
from lookahead.calibration import _calibration_step
from lookahead.costs import measure
from lookahead.support import check_model

FALLBACK = ["def fibonacci(n):\n", "Write a haiku about the sea.", "import numpy as np\n\ndef normalize(x):\n"]
SETTINGS = {  # name -> Lookahead arguments
    "Lookahead()": {},
    "Lookahead(W=0)": {"window_size": 0, "adaptive": True},
    "(4,4,4)": {"window_size": 4, "ngram_size": 4, "max_candidates": 4},
    "(15,5,15)": {"window_size": 15, "ngram_size": 5, "max_candidates": 15},
}


def prompts(tokenizer, n: int) -> list:
    try:
        found = datasets.load("humaneval", n) + datasets.load("mtbench", n)
        return [datasets.encode(tokenizer, p)["input_ids"][0].tolist() for p in found]
    except Exception as err:  # the data packages may be missing on the GPU machine
        print(f"datasets unavailable ({err}); using {len(FALLBACK)} built-in prompts")
        return [tokenizer(p)["input_ids"] for p in FALLBACK]


def batch_inputs(tokenizer, ids: list[list[int]], device) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(len(p) for p in ids)
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in ids], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in ids], device=device)
    return {"input_ids": input_ids, "attention_mask": mask, "pad_token_id": pad}


def exactness(model, tokenizer, ids: list[list[int]], new: int) -> dict:
    results = {}
    for name, setting in SETTINGS.items():
        same = 0
        for p in ids:
            x = torch.tensor([p], device=model.device)
            plain = model.generate(x, max_new_tokens=new, do_sample=False)
            mine = model.generate(x, max_new_tokens=new, do_sample=False, custom_generate=Lookahead(**setting))
            same += torch.equal(plain, mine)
        batch = batch_inputs(tokenizer, ids[:4], model.device)
        plain = model.generate(**batch, max_new_tokens=new, do_sample=False)
        mine = model.generate(**batch, max_new_tokens=new, do_sample=False, custom_generate=Lookahead(**setting))
        batched = bool(torch.equal(plain, mine))
        results[name] = {"identical_alone": f"{same}/{len(ids)}", "identical_batch_of_4": batched}
        print(f"exactness fp32 {name}: alone {same}/{len(ids)}, batch of 4 {'identical' if batched else 'DIFFERENT'}")
    return results


def syncs_per_step(model, tokenizer, ids: list[list[int]], new: int) -> dict:
    results = {}
    for batch in (1, 4):
        inputs = batch_inputs(tokenizer, ids[:batch], model.device)
        for name, setting in SETTINGS.items():
            la = Lookahead(**setting)
            model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=la)  # warm up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    model.generate(**inputs, max_new_tokens=new, do_sample=False, custom_generate=la)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            places = [
                str(w.filename).rsplit("/", 1)[-1] + ":" + str(w.lineno)
                for w in caught
                if "synchroniz" in str(w.message)
            ]
            where = dict(Counter(places).most_common(12))  # file:line -> syncs there
            syncs, steps = len(places), la.last_stats.steps
            results[f"batch {batch} {name}"] = {
                "syncs": syncs,
                "steps": steps,
                "per_step": syncs / steps,
                "where": where,
            }
            print(f"syncs batch {batch} {name}: {syncs} over {steps} forward passes ({syncs / steps:.2f} per step)")
            print(f"  where: {where}")
    return results


def curve(model) -> dict:
    spec = check_model(model)
    start = time.perf_counter()
    measured = measure(_calibration_step(model, spec))
    t1 = measured.points[0][1]
    ratios = {k: s / t1 for k, s in measured.points}
    print(f"cost curve bf16 ({time.perf_counter() - start:.1f} s): T(1) = {1000 * t1:.2f} ms; "
          + ", ".join(f"T({k})/T(1) = {r:.2f}" for k, r in ratios.items()))  # fmt: skip
    return {"T1_ms": 1000 * t1, "ratios": ratios}


@torch.no_grad()  # as generate runs: autograd would time (and keep) a graph per pass
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only tries the script (no sync counts)")
    parser.add_argument("--json")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: these checks are for a GPU machine")
    report = {"device": torch.cuda.get_device_name() if cuda else args.device, "torch": torch.__version__}
    report["transformers"] = transformers.__version__
    print(report)
    model, tokenizer = models.load(args.model, dtype="float32", device=args.device)
    ids = prompts(tokenizer, args.n)
    report["exactness_fp32"] = exactness(model, tokenizer, ids, args.new_tokens)
    model = model.to(torch.bfloat16)
    if cuda:
        report["syncs_bf16"] = syncs_per_step(model, tokenizer, ids, args.new_tokens)
    report["cost_curve_bf16"] = curve(model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
