"""Which vLLM proposer is faster, with the machine's drift taken out? Proposers take turns on the
same prompts in one engine: a paired, alternating comparison, one request at a time or ``--batch``
at once.

``vllm_bench.py`` runs each setup as a server of its own, one after another: honest about serving,
but a CPU whose speed drifts by 10% over minutes moves its one-client cells as much as the setups
differ (docs/journal.md). Here one engine runs every setup, switching between waves of requests
(``_switch.Switch``): each wave (one prompt, or ``--batch`` prompts sent at once, which the engine
batches) is decoded once per setup, the setups' order rotated from wave to wave, and each wave
timed alone. Reported per dataset and setup: output tokens/s over all waves, and the median and
geometric mean over waves of the paired ratio to every other setup. ``suffix`` runs only one
request at a time (the switch follows one request's tree).
A proposer's history is its own: the warm pool and suffix decoding's tree hold only the earlier
prompts that the same setup ran.

Runs in vLLM's environment with the engine in this process. Every setup runs under speculative
decoding's engine path (``plain`` proposes nothing), which vLLM runs without async scheduling: the
``plain`` here is vLLM's speculative path with empty drafts, about 3% slower than no speculation
at all (docs/journal.md).

    .venv-vllm/bin/python benchmarks/vllm_paired.py --dtype float32 --n 20 --max-tokens 256 \\
        --setups plain "ngram k=5" "ngram k=7" suffix lookahead --out docs/results/vllm-paired-...
    .venv-vllm/bin/python benchmarks/vllm_paired.py --batch 16 --n 32 --setups plain "ngram k=5" lookahead \
        --out docs/results/vllm-paired-...-batch16                      # 16 requests at a time
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import _switch
from vllm_bench import SPEC_COUNTERS

from lookahead import datasets, models


def prompt_ids(tokenizer, prompt: datasets.Prompt) -> list[int]:
    """The tokens vLLM's server would run: the chat template for chat prompts, the text itself else."""
    if not prompt.chat:
        return tokenizer(prompt.text)["input_ids"]
    messages = [{"role": "user", "content": prompt.text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def spec_counts(llm) -> dict[str, float]:
    """The engine's speculation counters now (``vllm_bench.SPEC_COUNTERS``)."""
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += metric.value
    return counts


def run_wave(llm, wave: list[list[int]], setup: str, args) -> dict:
    """Greedy requests under ``setup``, all at once (one at a time with ``--batch 1``): their tokens,
    the wall seconds of the wave and the speculation counters over it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _switch.MODE, _switch.REQUEST = setup, _switch.REQUEST + 1
    before = spec_counts(llm)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in wave],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)  # fmt: skip
    seconds = time.perf_counter() - start
    after = spec_counts(llm)
    texts = [tuple(out.outputs[0].token_ids) for out in outs]
    counts = {k: after[k] - before[k] for k in after}
    return {"tokens": sum(map(len, texts)), "seconds": seconds, "text": texts, **counts}


def summary(runs: dict[str, list[dict]]) -> dict:
    """Per setup: tokens/s over all prompts, speculation totals, and paired ratios to the others."""
    out = {}
    for setup, rows in runs.items():
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        drafted, accepted = sum(r["draft_tokens"] for r in rows), sum(r["accepted"] for r in rows)
        entry = {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "seconds": round(seconds, 2),
                 "waves": len(rows), "tokens_per_step": round(tokens / max(1, tokens - accepted), 3),
                 "acceptance": round(accepted / drafted, 3) if drafted else 0.0}  # fmt: skip
        for other, others in runs.items():
            if other != setup:
                ratios = [o["seconds"] / r["seconds"] for r, o in zip(rows, others, strict=True)]
                geomean = math.exp(statistics.fmean(map(math.log, ratios)))
                entry[f"vs {other}"] = {"median": round(statistics.median(ratios), 3), "geomean": round(geomean, 3)}
        out[setup] = entry
    return out


BANDS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 11), (12, 15), (16, 24))  # draft tokens per step


def step_costs(steps: list[tuple[str, int, float]]) -> dict:
    """Per setup and band of draft tokens: the steps timed and their median milliseconds."""
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(m for m, _, _ in steps):
        for low, high in BANDS:
            times = [s for m, k, s in steps if m == mode and low <= k <= high]
            if times:
                name = f"{low}" if low == high else f"{low}-{high}"
                median = round(1000 * statistics.median(times), 1)
                out.setdefault(mode, {})[name] = {"steps": len(times), "median": median}
    return out


def markdown(report: dict, setups: list[str]) -> str:
    lines = []
    for dataset, per in report["datasets"].items():
        at_once = "one request" if report["config"]["batch"] == 1 else f"{report['config']['batch']} requests"
        lines += [f"\n{dataset}, {at_once} at a time (tokens/s; paired ratios of waves: median / geometric mean)\n"]
        lines += ["| setup | tokens/s | tokens/step | " + " | ".join(f"vs {s}" for s in setups) + " |"]
        lines += ["|---" * (len(setups) + 3) + "|"]
        for setup in setups:
            e = per[setup]
            ratios = [f"{e[f'vs {s}']['median']:.2f} / {e[f'vs {s}']['geomean']:.2f}" if s != setup else "-"
                      for s in setups]  # fmt: skip
            lines.append(
                f"| {setup} | {e['tokens_per_s']:.1f} | {e['tokens_per_step']:.2f} | " + " | ".join(ratios) + " |"
            )
    lines += ["\nA step's median milliseconds (steps timed) by the draft tokens it verified\n"]
    bands = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in BANDS]
    lines += ["| setup | " + " | ".join(bands) + " |", "|---" * (len(bands) + 1) + "|"]
    for setup, per in report["step_ms"].items():
        cells = [f"{per[b]['median']:.1f} ({per[b]['steps']})" if b in per else "-" for b in bands]
        lines.append(f"| {setup} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"], choices=["humaneval", "mtbench"])
    p.add_argument("--setups", nargs="+", default=["plain", "ngram k=5", "ngram k=7", "suffix", "lookahead"])
    p.add_argument("--k", type=int, default=16, help="lookahead's most draft tokens")
    p.add_argument("--batch", type=int, default=1, help="requests at a time: each setup runs the same waves of them")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (starts in seconds, not minutes)")
    p.add_argument("--out", default="results/vllm-paired")
    args = p.parse_args(argv)
    if args.batch > 1 and "suffix" in args.setups:
        p.error("suffix runs one request at a time here (its tree follows one request): leave it out with --batch")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where MODE is set
    from vllm import LLM

    _switch.LOOKAHEAD_K = args.k
    cap = max([24 if "suffix" in args.setups else 1, args.k, *(int(s.split("=")[1]) for s in args.setups if "=" in s)])
    spec = {"method": "custom_class", "model": "_switch.Switch", "num_speculative_tokens": cap}
    llm = LLM(model=str(models.resolve(args.model)), dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.batch, seed=0, speculative_config=spec, distributed_executor_backend="uni",
              disable_log_stats=False, enforce_eager=args.enforce_eager)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    warm = [tokenizer("def hello_world():")["input_ids"]] * args.batch  # a full wave: its batch shapes compile here
    for setup in args.setups:  # warm every path once (compilation, the proposers' first calls)
        run_wave(llm, warm, setup, argparse.Namespace(max_tokens=8))
    report = {"config": vars(args), "datasets": {}, "differing": []}
    for name in args.datasets:
        runs = {setup: [] for setup in args.setups}
        prompts = getattr(datasets, name)(args.n)
        for i in range(0, len(prompts), args.batch):
            wave = prompts[i : i + args.batch]
            ids = [prompt_ids(tokenizer, prompt) for prompt in wave]
            turn = (i // args.batch) % len(args.setups)
            order = args.setups[turn:] + args.setups[:turn]
            for setup in order:
                runs[setup].append(run_wave(llm, ids, setup, args))
            texts = {s: runs[s][-1].pop("text") for s in args.setups}
            for j, prompt in enumerate(wave):
                if len({t[j] for t in texts.values()}) > 1:
                    report["differing"].append(prompt.id)
            print(json.dumps({"wave": [p.id for p in wave], **{s: round(runs[s][-1]["seconds"], 2) for s in order}}),
                  flush=True)  # fmt: skip
        report["datasets"][name] = summary(runs)
    report["step_ms"] = step_costs(_switch.STEPS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    table = markdown(report, args.setups)
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
