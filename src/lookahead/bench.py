"""``lookahead bench``: lookahead against plain greedy and prompt lookup, measured honestly.

All methods run in one process, alternating prompt by prompt, so that machine drift cancels out.
Speedups are medians of per-prompt ratios against plain greedy on the same prompt. At batch 1,
every method's text is also scored against the clairvoyant bound (``lookahead.bound``: the
speedup a policy that knew which candidates match would reach, paying the model's cost curve),
so that a policy is judged by how much of what its candidates allow it reaches. Like the
speedups, the bound is the whole call's: the prefill, which no policy shortens, is in both. Where
the prompts are of several kinds (MT-bench's categories), speedups are also reported per kind, with
a 95% interval from the spread of the kind's prompts, so that a kind slower than greedy beyond
noise stands out. Results go to a JSON file, a Markdown table and PNG plots (matplotlib).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import datasets
from .bound import clairvoyant_bounds, prompt_lookup_candidates
from .calibration import model_cost_curve
from .costs import CostCurve
from .decoding import Lookahead

logger = logging.getLogger(__name__)

BOUND_CAP = 7  # the longest candidate the clairvoyant policy verifies (lookahead.bound)


@dataclass
class Method:
    name: str
    kwargs: Callable[[], dict]  # fresh generate kwargs for one call
    lookahead: Lookahead | None = None
    batches: bool = True  # runs on a batch of several prompts (transformers' prompt lookup does not)
    longest: int | None = None  # the longest candidate it verifies, where no Lookahead says (prompt lookup)
    # (prompt, output) -> the candidates its loop had at each output position, where no Lookahead
    # records them (prompt lookup's, recomputed from the text): the bound counts them too
    candidates: Callable[[list[int], list[int]], dict] | None = None


@dataclass
class Run:
    method: str
    prompt: str
    new_tokens: int
    seconds: float
    identical: bool
    peak_mb: float
    tokens_per_step: float | None = None
    accepted_hist: list[int] = field(default_factory=list)
    wide_share: float | None = None  # share of lookahead steps that were wide (the rest: plain)
    settings: dict[str, int] | None = None  # steps per setting the tuner chose ("plain", "G=1,N=4", ...)
    repeat_seconds: list[float] = field(default_factory=list)  # every timing of this call; seconds: their median
    bound: float | None = None  # the clairvoyant speedup of the call on this run's text (batch 1; _call_bounds)
    bound_own_cap: float | None = None  # the same with candidates no longer than the method's own
    own_cap: int | None = None  # the method's longest candidate (lookahead: N - 1)
    bound_decode: float | None = None  # the bound of the decoding alone, the prefill left out (lookahead.bound)
    prefill_seconds: float | None = None  # lookahead's prefill of the prompt (the same forward pass for all)
    kind: str = ""  # the prompt's kind (datasets.Prompt.kind; a batch's kinds joined by "+")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def methods_for(
    window_size=None,
    ngram_size=None,
    max_candidates=None,
    prompt_lookup_tokens=3,
    adaptive=False,
    device="cpu",
    num_beams=1,
) -> list[Method]:
    """greedy, prompt lookup and ``Lookahead()``; and, if any of W/N/G is given, ``Lookahead(W, N,
    G)`` too: as given, or with ``adaptive`` chosen step by step with them as upper bounds (so
    ``window_size=0, adaptive=True`` is ``Lookahead()`` without the Jacobi window). ``device``
    names it: the W/N/G left unset are that device's defaults. ``num_beams`` > 1: plain beam
    search and ``Lookahead()``'s, the first the baseline (prompt lookup does not do beams)."""
    if num_beams > 1:
        return _beam_methods(num_beams)
    auto = Lookahead(record_candidates=True)
    chosen = [
        Method("greedy", dict),
        Method(
            f"prompt_lookup({prompt_lookup_tokens})",
            lambda: {"prompt_lookup_num_tokens": prompt_lookup_tokens},
            batches=False,
            longest=prompt_lookup_tokens,
            candidates=lambda prompt, output: prompt_lookup_candidates(prompt, output, length=prompt_lookup_tokens),
        ),
        Method("lookahead(auto)", lambda: {"custom_generate": auto}, auto),
    ]
    if any(v is not None for v in (window_size, ngram_size, max_candidates)):
        fixed = Lookahead(window_size, ngram_size, max_candidates, adaptive=adaptive or None, record_candidates=True)
        cfg = fixed.config_for(device)
        name = f"lookahead({'auto, ' if adaptive else ''}{cfg.window_size},{cfg.ngram_size},{cfg.max_candidates})"
        chosen.append(Method(name, lambda: {"custom_generate": fixed}, fixed))
    return chosen


def _beam_methods(num_beams: int) -> list[Method]:
    auto = Lookahead()
    return [
        Method(f"beam({num_beams})", lambda: {"num_beams": num_beams}),
        Method(f"lookahead beam({num_beams})", lambda: {"num_beams": num_beams, "custom_generate": auto}, auto),
    ]


class PeakMemory:
    """Peak memory (MB) while the block runs, model weights included: the process's resident
    memory at its highest, sampled every 5 ms, on CPU; the most memory allocated on GPUs. (The
    increase over the start would read 0 on CPU: the allocator reuses what earlier calls freed.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        import psutil

        self._proc = psutil.Process()
        self._high = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._high = max(self._high, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self._high = max(self._high, self._proc.memory_info().rss)
            self.peak = self._high / 2**20


def generated_tokens(out: torch.Tensor, prompt_len: int, eos_ids: set[int]) -> int:
    """New tokens of all rows, each up to and including its first EOS (not the padding after)."""
    total = 0
    for row in out[:, prompt_len:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def run_bench(
    model,
    tokenizer,
    prompts: list[datasets.Prompt],
    methods: list[Method],
    max_new_tokens: int,
    progress: bool = True,
    batch_size: int = 1,
    repeats: int = 1,
    time_budget: float | None = None,
) -> list[Run]:
    """Every method on every batch of ``batch_size`` prompts, alternating; one Run per (batch,
    method). Methods that cannot batch are left out when ``batch_size > 1``.

    ``repeats``: each batch's methods are timed that many times, in rounds, each round starting
    one method later (a machine whose speed drifts would otherwise favour whoever runs last), and
    a Run's ``seconds`` is the median. Outputs, tokens and step statistics are the first round's.
    A later round times the same call again. The text is the same, but ``Lookahead()`` carries its
    drafting statistics from call to call, so a later round's steps can differ slightly.

    ``time_budget``: seconds; once they have passed (counted from the first timed batch), no
    further batch is started, so the Runs cover the batches that were (at least one). For a
    machine held for a fixed time: the report is of fewer prompts rather than of none."""
    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    methods = [m for m in methods if batch_size == 1 or m.batches]
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    # the clairvoyant bound is for one sequence decoded greedily
    curve = model_cost_curve(model) if batch_size == 1 and methods[0].name == "greedy" else None
    warmup = datasets.encode_batch(tokenizer, groups[0])
    for method in methods:  # first calls pay one-time costs (allocations, the model probe)
        model.generate(**{k: v.to(model.device) for k, v in warmup.items()}, max_new_tokens=4, **method.kwargs())
    total = len(groups) * len(methods) * repeats
    bar = tqdm(total=total, disable=not progress, unit="run", desc=f"bench (batch {batch_size})")
    timer = _BatchTimer(model, methods, max_new_tokens, repeats, _eos_ids(model), curve, bar.update)
    runs: list[Run] = []
    started = time.perf_counter()
    for done, group in enumerate(groups):
        if time_budget is not None and done and time.perf_counter() - started > time_budget:
            logger.warning(
                "bench: the time budget of %.0f s ran out after %d of %d batches; the rest were skipped",
                time_budget, done, len(groups),
            )  # fmt: skip
            break
        inputs = {k: v.to(model.device) for k, v in datasets.encode_batch(tokenizer, group).items()}
        runs += timer.runs(group, inputs)
    bar.close()
    return runs


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


@dataclass
class _BatchTimer:
    """Times every method of :func:`run_bench` on one batch of prompts (:meth:`runs`)."""

    model: object
    methods: list[Method]
    max_new_tokens: int
    repeats: int
    eos_ids: set[int]
    curve: CostCurve | None  # the model's, for the clairvoyant bound; None for a batch
    tick: Callable[[], object]  # called after every timed call (the progress bar)

    def runs(self, group: list[datasets.Prompt], inputs: dict) -> list[Run]:
        """One Run per method: the first round's output and statistics, the median of every
        round's seconds, and (batch 1) the call's clairvoyant bound."""
        reference = None
        mine: list[Run] = []
        for method in self.methods:
            out, seconds, peak = self.timed(method, inputs)
            if reference is None:
                reference = out  # greedy runs first
            mine.append(self._run(method, group, inputs, out, reference, seconds, peak))
        for round_ in range(1, self.repeats):  # each later round starts one method later
            shift = round_ % len(self.methods)
            for i in [*range(shift, len(self.methods)), *range(shift)]:
                mine[i].repeat_seconds.append(self.timed(self.methods[i], inputs)[1])
        for run in mine:
            run.seconds = statistics.median(run.repeat_seconds)
        if self.curve is not None:
            _call_bounds(mine)
        return mine

    def timed(self, method: Method, inputs: dict) -> tuple[torch.Tensor, float, float]:
        """One generate call: its output [B, S + T], seconds and peak memory (MB)."""
        kwargs = dict(max_new_tokens=self.max_new_tokens, do_sample=False, **method.kwargs())
        with PeakMemory(self.model.device) as memory:
            start = time.perf_counter()
            out = self.model.generate(**inputs, **kwargs)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        self.tick()
        return out, seconds, memory.peak

    def _run(
        self,
        method: Method,
        group: list[datasets.Prompt],
        inputs: dict,
        out: torch.Tensor,  # [B, S + T]
        reference: torch.Tensor,  # [B, S + T]: greedy's output
        seconds: float,
        peak: float,
    ) -> Run:
        """The Run of method's first call, read just after it (its Lookahead's statistics and
        candidates are the latest call's)."""
        start_len = inputs["input_ids"].shape[1]
        stats = method.lookahead.last_stats if method.lookahead else None
        beams = method.lookahead.last_beam_stats if method.lookahead and stats is None else None
        new_tokens = generated_tokens(out, start_len, self.eos_ids)
        bounds = {}
        if self.curve is not None and method.name != "greedy":
            output = out[0, start_len:].tolist()[:new_tokens]
            bounds = _bounds(inputs["input_ids"][0].tolist(), output, self.curve, method)
        return Run(
            method=method.name,
            prompt="+".join(p.id for p in group),
            kind="+".join(dict.fromkeys(p.kind for p in group)),
            new_tokens=new_tokens,
            seconds=seconds,
            identical=out.shape == reference.shape and bool((out == reference).all()),
            peak_mb=peak,
            **(_step_fields(stats) if stats else {}),
            **({"tokens_per_step": beams.depths / (1 + beams.steps)} if beams else {}),
            **bounds,
            repeat_seconds=[seconds],
        )


def _step_fields(stats) -> dict:
    """A Run's fields from a Lookahead call's statistics (``LookaheadStats``)."""
    return {
        "tokens_per_step": stats.tokens_per_step,
        "accepted_hist": list(stats.accepted_hist),
        "wide_share": stats.wide_steps / max(1, stats.steps - 1),
        "settings": dict(stats.settings),
        "prefill_seconds": stats.prefill_seconds,
    }


def _bounds(prompt: list[int], output: list[int], curve, method: Method) -> dict:
    """The clairvoyant bound on one run's text: with candidates up to BOUND_CAP tokens, and up to
    the method's own longest (lookahead: N - 1, or its draft length where it count-drafts;
    counting the candidates its loop had at hand)."""
    extra, own = None, method.longest
    if method.candidates is not None:
        extra = method.candidates(prompt, output)
    if method.lookahead is not None:
        extra = method.lookahead.last_candidates[0] if method.lookahead.last_candidates else None
        own = method.lookahead.last_stats.config.max_emitted - 1
    bounds = clairvoyant_bounds(prompt, output, curve, caps=(BOUND_CAP, own or 0), extra=extra)
    capped = bounds[own].speedup if own is not None else None
    return {"bound": bounds[BOUND_CAP].speedup, "bound_own_cap": capped, "own_cap": own}


def _call_bounds(group: list[Run]) -> None:
    """Turn each run's bound from the decoding's (lookahead.bound: tokens after the first, per
    plain step) into the call's, which is what a measured speedup is: no policy shortens the
    prefill, so the clairvoyant call takes the prefill plus its decoding. In greedy's time per
    token t (greedy's call less the prefill, over its tokens after the first) and the prefill's P:
    (n / (P + (n - 1) t / bound)) / (greedy's n / greedy's seconds). Without a lookahead run to
    time the prefill, or with greedy's call too short to say, the decoding's bound stands."""
    greedy = next(r for r in group if r.method == "greedy")
    prefills = [r.prefill_seconds for r in group if r.prefill_seconds]
    prefill = min(prefills) if prefills else None
    usable = prefill is not None and greedy.new_tokens > 1 and greedy.seconds > prefill
    per_token = (greedy.seconds - prefill) / (greedy.new_tokens - 1) if usable else None
    greedy_rate = greedy.new_tokens / greedy.seconds

    def call(decode: float, tokens: int) -> float:  # tokens per second over greedy's, at the bound
        return tokens / (prefill + (tokens - 1) * per_token / decode) / greedy_rate

    for run in group:
        if run.bound is None:
            continue
        run.bound_decode = run.bound
        if per_token is None or run.new_tokens < 2:
            continue
        run.bound = call(run.bound, run.new_tokens)
        if run.bound_own_cap is not None:
            run.bound_own_cap = call(run.bound_own_cap, run.new_tokens)


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
        per_step = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
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
            own = "-" if r["bound_own_cap"] is None else f"{r['bound_own_cap']:.2f}x"
            own_share = "-" if r["share_of_bound_own_cap"] is None else f"{r['share_of_bound_own_cap']:.0%}"
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
            per_step = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
            wide = "-" if r["wide_share"] is None else f"{r['wide_share']:.0%}"
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
