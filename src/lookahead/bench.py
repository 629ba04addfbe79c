"""``lookahead bench``: lookahead against plain greedy and prompt lookup, measured honestly.

All methods run in one process, alternating prompt by prompt, so that machine drift cancels out.
Speedups are medians of per-prompt ratios against plain greedy on the same prompt. At batch 1,
every method's text is also scored against the clairvoyant bound (``lookahead.bound``: the
speedup a policy that knew which candidates match would reach, paying the model's cost curve),
so that a policy is judged by how much of what its candidates allow it reaches. Like the
speedups, the bound is the whole call's: the prefill, which no policy shortens, is in both. Where
the prompts are of several kinds (MT-bench's categories), speedups are also reported per kind, with
a 95% interval from the spread of the kind's prompts, so that a kind slower than greedy beyond
noise stands out. This module runs and times the methods; ``lookahead.report`` summarises the runs
and writes them: a JSON file, a Markdown table and PNG plots (matplotlib).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
