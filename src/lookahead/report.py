"""The bench's report: per-method summaries (speedups over the baseline on the same prompt, shares
of the clairvoyant bound), per-kind rows with their intervals, per-prompt and per-batch tables, the
plots, and ``write_report``, which writes NAME.json, NAME.md and NAME.png. ``lookahead.bench`` runs
and times the methods; this module only reads its ``Run`` records.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import torch

from .bench import BOUND_CAP, Run


def _shares(bounded: list[Run], greedy: dict[str, Run]) -> dict:
    """A method's share of the bound, per prompt and pooled: ``share_median_prompt``, the median
    of each prompt's speedup over its own bound; ``share_pooled``, the seconds all its calls would
    have taken at their bounds (each prompt's tokens at its bound times greedy's rate on it) over
    the seconds they took. The summary's ``share_of_bound`` (median speedup over median bound, the
    one reported before these) divides figures of two different prompts where speedups and bounds
    rank the prompts differently."""
    if not bounded:
        return {"share_median_prompt": None, "share_pooled": None}
    per_prompt = [speedup(r, greedy[r.prompt]) / r.bound for r in bounded]
    at_bound = sum(r.new_tokens / (r.bound * greedy[r.prompt].tokens_per_second) for r in bounded)
    return {
        "share_median_prompt": statistics.median(per_prompt),
        "share_pooled": at_bound / sum(r.seconds for r in bounded),
    }


def greedy_by_prompt(runs: list[Run]) -> dict[str, Run]:
    """The baseline's run of each prompt (or batch), what every other method is measured against:
    plain greedy, or plain beam search in a beam run (the first method run)."""
    baseline = runs[0].method if runs else "greedy"
    return {r.prompt: r for r in runs if r.method == baseline}


def speedup(run: Run, greedy: Run) -> float:
    """Tokens per second relative to greedy on the same prompt."""
    return greedy.seconds / run.seconds * run.new_tokens / greedy.new_tokens


def summarize(runs: list[Run]) -> list[dict]:
    """One row per method: median tokens/s, median speedup over greedy, tokens/step, ..."""
    greedy = greedy_by_prompt(runs)
    rows = []
    for name in dict.fromkeys(r.method for r in runs):
        mine = [r for r in runs if r.method == name]
        hists = [r.accepted_hist for r in mine if r.accepted_hist]
        hist = [sum(col) for col in zip(*hists, strict=True)] if hists else []
        steps = [r.new_tokens / r.tokens_per_step for r in mine if r.tokens_per_step]
        ratios = [speedup(r, greedy[r.prompt]) for r in mine]
        bounds = [r.bound for r in mine if r.bound is not None]
        capped = [r.bound_own_cap for r in mine if r.bound_own_cap is not None]
        decode = [r.bound_decode for r in mine if r.bound_decode is not None]
        shares = _shares([r for r in mine if r.bound is not None], greedy)
        settings: dict[str, int] = {}
        for r in mine:
            for key, count in (r.settings or {}).items():
                settings[key] = settings.get(key, 0) + count
        rows.append(
            {
                "method": name,
                "tokens_per_second": statistics.median(r.tokens_per_second for r in mine),
                "speedup": statistics.median(ratios),
                "speedup_geomean": statistics.geometric_mean(ratios),
                # known for lookahead (its stats) and greedy (1); prompt lookup does not report it
                "tokens_per_step": sum(r.new_tokens for r in mine) / sum(steps)
                if steps
                else (1.0 if name == mine[0].method == runs[0].method else None),
                "accepted_hist": hist,
                "identical": sum(r.identical for r in mine) / len(mine),
                "peak_mb": max(r.peak_mb for r in mine),
                "throughput": sum(r.new_tokens for r in mine) / sum(r.seconds for r in mine),
                "wide_share": statistics.mean(r.wide_share for r in mine) if mine[0].wide_share is not None else None,
                "settings": dict(sorted(settings.items(), key=lambda kv: -kv[1])) or None,
                # the clairvoyant bound (median over prompts) and the median speedup's share of it
                "bound": statistics.median(bounds) if bounds else None,
                "bound_decode": statistics.median(decode) if decode else None,
                "share_of_bound": statistics.median(ratios) / statistics.median(bounds) if bounds else None,
                # the same share, read two more ways: the median prompt's share of its own bound, and
                # all prompts' time at their bounds over all their time (see _shares)
                **shares,
                "bound_own_cap": statistics.median(capped) if capped else None,
                "share_of_bound_own_cap": statistics.median(ratios) / statistics.median(capped) if capped else None,
            }
        )
    return rows


# two-sided 95% quantiles of Student's t by degrees of freedom; beyond the table, 1.96 + 2.37 / df
# (the first term of its expansion in 1 / df: 2.039 at 30, where the table says 2.042)
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def kind_rows(runs: list[Run]) -> list[dict]:
    """Per method (greedy aside) and prompt kind: how many prompts, the median and geometric-mean
    speedup over greedy, a 95% interval for the kind's geometric mean (Student's t over the
    prompts' log speedups: the prompts of a kind are a sample of it, and their spread, timing
    noise included, is the noise; None for a single prompt), and the slowest prompt.
    ``below_one``: the whole interval lies under 1.0x, a kind slower than greedy beyond noise."""
    greedy = greedy_by_prompt(runs)
    out = []
    for name in dict.fromkeys(r.method for r in runs if r.method != runs[0].method):
        mine = [r for r in runs if r.method == name]
        for kind in dict.fromkeys(r.kind for r in mine):
            ratios = {r.prompt: speedup(r, greedy[r.prompt]) for r in mine if r.kind == kind}
            logs = [math.log(x) for x in ratios.values()]
            mean = statistics.fmean(logs)
            low = high = None
            freedom = len(logs) - 1
            if freedom:
                t = _T95[freedom - 1] if freedom <= len(_T95) else 1.96 + 2.37 / freedom
                half = t * statistics.stdev(logs) / math.sqrt(len(logs))
                low, high = math.exp(mean - half), math.exp(mean + half)
            slowest = min(ratios, key=ratios.get)
            out.append(
                {
                    "method": name,
                    "kind": kind,
                    "prompts": len(ratios),
                    "speedup": statistics.median(ratios.values()),
                    "speedup_geomean": math.exp(mean),
                    "interval": None if low is None else [low, high],
                    "slowest": ratios[slowest],
                    "slowest_prompt": slowest,
                    "below_one": high is not None and high < 1.0,
                }
            )
    return out


def kind_markdown(kinds: list[dict]) -> str:
    """The per-kind table (``kind_rows``), and which kinds fall below 1.0x beyond noise; empty
    when every prompt is of one kind (the summary says it all)."""
    if len({k["kind"] for k in kinds}) < 2:
        return ""
    lines = [
        "By prompt kind: speedup over greedy; the interval is 95% for the kind's geometric mean, from "
        "the spread of its prompts (none for one prompt):",
        "",
        "| method | kind | prompts | speedup (median) | geomean | 95% interval | slowest |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in kinds:
        interval = "-" if k["interval"] is None else f"{k['interval'][0]:.2f}-{k['interval'][1]:.2f}x"
        lines.append(
            f"| {k['method']} | {k['kind'] or '-'} | {k['prompts']} | {k['speedup']:.2f}x "
            f"| {k['speedup_geomean']:.2f}x | {interval} | {k['slowest']:.2f}x ({k['slowest_prompt']}) |"
        )
    below = [f"{k['method']} on {k['kind'] or '-'}" for k in kinds if k["below_one"]]
    lines += ["", f"Below 1.0x beyond noise (the whole interval under 1): {', '.join(below) or 'none'}."]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], title: str) -> str:
    base = rows[0]["method"] if rows else "greedy"  # the baseline: greedy, or plain beam search
    lines = [
        f"### {title}",
        "",
        f"| method | tokens/s (median) | speedup vs {base} (median) | (geometric mean) | tokens/step "
        f"| accepted-length histogram | identical to {base} | peak memory (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hist = " ".join(str(x) for x in r["accepted_hist"]) or "-"
        per_step = _cell(r["tokens_per_step"], ".2f")
        lines.append(
            f"| {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {r['speedup_geomean']:.2f}x "
            f"| {per_step} | {hist} | {r['identical']:.0%} | {r['peak_mb']:.0f} |"
        )
    bounded = [r for r in rows if r.get("bound") is not None]
    if bounded:
        lines += [
            "",
            f"Against the clairvoyant bound (lookahead.bound: every candidate's match known in advance, this "
            f"model's cost curve; candidates up to {BOUND_CAP} tokens, and up to the method's own longest; the "
            f"call's, the prefill included as the speedups include it). Share: the median speedup over the median "
            f"bound; (median prompt): the median of each prompt's speedup over its own bound; (pooled): the time "
            f"all calls would take at their bounds over the time they took:",
            "",
            f"| method | speedup (median) | bound, cap {BOUND_CAP} (median) | share | share (median prompt) "
            "| share (pooled) | bound, own cap | share |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in bounded:
            own = _cell(r["bound_own_cap"], ".2f", "x")
            own_share = _cell(r["share_of_bound_own_cap"], ".0%")
            lines.append(
                f"| {r['method']} | {r['speedup']:.2f}x | {r['bound']:.2f}x | {r['share_of_bound']:.0%} "
                f"| {r['share_median_prompt']:.0%} | {r['share_pooled']:.0%} | {own} | {own_share} |"
            )
    chosen = [r for r in rows if r.get("settings")]
    if chosen:
        lines.append("")
        for r in chosen:
            total = sum(r["settings"].values())
            shares = ", ".join(f"{k} {v / total:.0%}" for k, v in r["settings"].items())
            lines.append(f"Steps by setting, {r['method']}: {shares}.")
    return "\n".join(lines) + "\n"


def prompt_markdown(runs: list[Run]) -> str:
    """Per prompt (and its kind, where there are several): each method's speedup over greedy, the
    clairvoyant bound on its text (cap BOUND_CAP) and the share of it reached."""
    greedy = greedy_by_prompt(runs)
    names = list(dict.fromkeys(r.method for r in runs if r.bound is not None))
    if not names:
        return ""
    kinds = len({r.kind for r in greedy.values()}) > 1  # a column for them where there are several
    lines = [
        "| prompt | "
        + ("kind | " if kinds else "")
        + " | ".join(f"{n}: speedup / bound (share)" for n in names)
        + " |",
        "|---|" + "---|" * (len(names) + kinds),
    ]
    for prompt, base in greedy.items():
        cells = []
        for name in names:
            run = next((r for r in runs if r.method == name and r.prompt == prompt), None)
            if run is None or run.bound is None:
                cells.append("-")
            else:
                ratio = speedup(run, base)
                cells.append(f"{ratio:.2f}x / {run.bound:.2f}x ({ratio / run.bound:.0%})")
        lines.append(f"| {prompt} | " + (f"{base.kind} | " if kinds else "") + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def batch_markdown(by_batch: dict[int, list[dict]], title: str) -> str:
    """Throughput by batch size: total new tokens / total seconds per method, and the median
    per-batch speedup over batched greedy."""
    lines = [
        f"### {title}",
        "",
        "| batch | method | tokens/s (all rows) | speedup vs batched greedy (median) | tokens/step per row "
        "| wide steps | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, rows in by_batch.items():
        for r in rows:
            per_step = _cell(r["tokens_per_step"], ".2f")
            wide = _cell(r["wide_share"], ".0%")
            lines.append(
                f"| {batch} | {r['method']} | {r['throughput']:.1f} | {r['speedup']:.2f}x | {per_step} | {wide} "
                f"| {r['identical']:.0%} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    greedy = greedy_by_prompt(runs)
    prompts = list(greedy)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in dict.fromkeys(r.method for r in runs if r.method != runs[0].method):
        by_prompt = {r.prompt: r for r in runs if r.method == name}
        ratios = [speedup(by_prompt[p], greedy[p]) for p in prompts]
        left.plot(range(len(prompts)), ratios, marker="o", label=name)
    left.axhline(1.0, color="grey", lw=1, ls="--")
    left.set(title=f"{title}: speedup over {runs[0].method} per prompt", xlabel="prompt", ylabel="speedup (x)")
    left.legend()
    hists = [r for r in rows if r["accepted_hist"]]
    width = 0.8 / max(1, len(hists))
    for i, r in enumerate(hists):
        total = sum(r["accepted_hist"]) or 1
        xs = [k + 1 + (i - (len(hists) - 1) / 2) * width for k in range(len(r["accepted_hist"]))]
        right.bar(xs, [c / total for c in r["accepted_hist"]], width=width, label=r["method"])
    right.set(title="tokens per step", xlabel="tokens verified in a step", ylabel="share of steps")
    right.set_xticks(range(1, 1 + max((len(r["accepted_hist"]) for r in hists), default=1)))
    left.set_xticks(range(len(prompts)))
    kinds = [greedy[p].kind for p in prompts]
    if len(set(kinds)) > 1:  # name each prompt's kind under it
        left.set_xticklabels(kinds, rotation=90, fontsize=7)
    if hists:
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curve_line(points: list[list[float]]) -> str:
    """The cost curve a report's steps and bounds were priced with, as T(k)/T(1)."""
    unit = points[0][1]  # T(1): a CostCurve starts at one token
    shown = [point for point in points[1:] if point[0] <= 16] or points[1:]
    ratios = ", ".join(f"{seconds / unit:.2f}" for _, seconds in shown)
    counts = ", ".join(str(int(k)) for k, _ in shown)
    curve = f"T(k)/T(1) = {ratios} for k = {counts}; T(1) = {1000 * unit:.1f} ms"
    return f"Cost curve (this machine's, as stored): {curve}."


def write_report(runs: list[Run], out_dir: Path, name: str, meta: dict) -> tuple[str, list[dict]]:
    """Write NAME.json, NAME.md and NAME.png under out_dir; return the Markdown and the rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs)
    # by kind at batch 1 only: a batch's prompts are consecutive ones of datasets.spread's order,
    # which takes kinds in turn, so a batch mixes kinds
    kinds = kind_rows(runs) if meta.get("batch_size", 1) == 1 else []
    meta = {**meta, "load_average": os.getloadavg()[0], "torch_threads": torch.get_num_threads()}
    batch = f", batch {meta['batch_size']}" if meta.get("batch_size", 1) > 1 else ""
    timed = f", median of {meta['repeats']} timings" if meta.get("repeats", 1) > 1 else ""
    weights = f", {meta['quantization']} weights" if meta.get("quantization") else ""
    table = markdown(
        rows,
        f"{name} ({meta['model']}, {meta['dtype']}{weights}, {meta['n']} prompts, {meta['max_new_tokens']} new tokens"
        f"{batch}{timed})",
    )
    by_kind = kind_markdown(kinds)
    table += f"\n{by_kind}" if by_kind else ""
    if meta.get("cost_curve"):
        table += f"\n{curve_line(meta['cost_curve'])}\n"
    (out_dir / f"{name}.json").write_text(
        json.dumps({"meta": meta, "summary": rows, "kinds": kinds, "runs": [r.__dict__ for r in runs]}, indent=1)
    )
    per_prompt = prompt_markdown(runs)
    per_prompt = f"\nPer prompt:\n\n{per_prompt}" if per_prompt else ""
    (out_dir / f"{name}.md").write_text(table + per_prompt + f"\nload average at the end: {meta['load_average']:.2f}\n")
    plot(runs, rows, out_dir / f"{name}.png", name)
    return table, rows


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: ``value`` formatted by ``spec`` with ``unit`` after it, or "-" where unknown."""
    return "-" if value is None else f"{value:{spec}}{unit}"
