"""What share of the clairvoyant bound does a drafting policy reach, and at what modeled speed?
Answered in seconds, with no clock.

The model runs once per prompt (plain greedy, to get its text, kept in ``--texts``); every policy
is then *replayed* over those texts with an oracle in place of the forward pass: the greedy choice
at each slot of a step is the text's next token at that slot's position. Along the path
verification follows (t, then every candidate token the model agreed with) that is exactly the
model's own choice, since this is its greedy text; so the policy takes the same steps as on the
model (it was checked on three HumanEval prompts in bf16: same texts, 0-1 steps apart per
prompt). Each step is priced with a cost curve (``_curves.py``): modeled speedup = (new tokens -
1) / the sum over steps of T(k)/T(1), the prefill left out as the bound (``lookahead.bound``,
computed on the same text with the same curve) leaves it out. 40 prompts x 256 tokens replay in
about 10 s. Prints a row per curve, dataset and policy; ``--json`` keeps every replay.

It cannot replay the Jacobi window (its guesses are the model's, off the text's path): use it for
policies without one (the CPU default).

    .venv/bin/python benchmarks/draft_replay.py                           # Lookahead(), stored curve
    .venv/bin/python benchmarks/draft_replay.py --curves stored stored-float16 stored-float32 steep mid flat gpu \\
        --losses                                                          # docs/choosing-wng.md
    .venv/bin/python benchmarks/draft_replay.py --n 1 --max-new-tokens 16 --datasets humaneval \\
        --curves gpu                                                      # smallest: seconds
    .venv/bin/python benchmarks/draft_replay.py --curves stored steep flat gpu \\
        --policies auto '{"draft_length": 3}' '{"_drafter": {"probe_overhead": 0.05}}'
    .venv/bin/python benchmarks/draft_replay.py --batch 4 --policies auto \\
        '{"window_size": 0, "ngram_size": 8, "max_candidates": 4, "adaptive": true}'

``--losses`` splits, per curve, dataset and policy, what the replay lost against the step the
clairvoyant would have taken at the same place (the best match among the trie's own nodes, cut to
its most tokens per unit of cost), in percent of the replay's cost: drafted steps that accepted
nothing (and how many of those had no source matching the text's next token at all: nothing to
draft), plain steps where a source matched, steps that accepted less than the best path, trees
wider than the path they accepted, probes, and the rest (a tree that was the path taken, where a
shorter cut paid more per token); and the drafted steps at the margin (expected
tokens per unit of cost under 1.2): what they expected against what they got.
``--first-token-oracle`` asks what knowing where the text leaves its sources would be worth: a
drafted tree none of whose first tokens is the text's next token becomes a plain step (the depth
of every draft still estimated).

A policy is a name from ``POLICIES`` or a JSON object of ``Lookahead`` keyword
arguments (``"_drafter"``: ``TreeDrafter`` arguments). ``--batch B`` replays groups of B prompts
through one batched call and reports the modeled speedup per group (plain decoding of a batch
takes as many steps as its longest output). With ``--batch-costs`` the steps are chosen, as
``Lookahead()`` chooses them, and priced in seconds by the costs this machine stored for the
model over batch shapes (``costs.BatchCosts``: a batch's step grows dearer with its size and
cache, and a smaller batch's plain step costs about what a larger one's does);
``--laggard-power`` replays with several weightings of the sequences behind
(``engine.Engine._weights``; 0 counts every sequence's tokens alike):

    .venv/bin/python benchmarks/draft_replay.py --batch 8 --max-new-tokens 128 --batch-costs \\
        --laggard-power 0 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import _curves
import torch
import transformers

from lookahead import Lookahead, assembly, calibration, datasets, engine, models
from lookahead.bound import clairvoyant_bounds
from lookahead.drafting import TreeDrafter
from lookahead.runner import DecoderRunner
from lookahead.support import check_model

POLICIES = {  # name -> Lookahead keyword arguments ("_drafter": TreeDrafter's)
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


class Oracle:
    """Stands in for the model inside :class:`DecoderRunner`: answers each slot with the true
    text's next token, and prices every step with ``curve``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.texts: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + greedy output
        self.curve = None
        self.cost = 0.0  # plain steps' worth of forward passes since the last reset
        # --batch-costs: seconds of a step of B sequences x k tokens after C cached columns
        self.seconds: Callable[[int, int, int], float] | None = None

    def logits(self, choices: list[list[int]]) -> torch.Tensor:  # [B][K] -> [B, K, V]
        index = torch.tensor(choices)
        out = torch.zeros(*index.shape, self.vocab, dtype=torch.bfloat16)
        return out.scatter_(-1, index[..., None], 1.0)

    def install(self) -> None:
        oracle = self

        def after(text: list[int], position: int) -> int:
            return text[position + 1] if position + 1 < len(text) else 0

        def prefill(runner, prompts, media=None):  # text prompts only
            runner.n_cached = [len(p) for p in prompts]
            runner.replay_columns = max(len(p) for p in prompts)
            runner.texts = [oracle.texts[tuple(p)] for p in prompts]
            firsts = [[after(text, len(p) - 1)] for text, p in zip(runner.texts, prompts, strict=True)]
            return oracle.logits(firsts)[:, 0]

        def step(runner, layout, step_ids):
            if oracle.seconds is not None:
                oracle.cost += oracle.seconds(len(step_ids), layout.length, runner.replay_columns)
            else:
                oracle.cost += oracle.curve.ratio(layout.length, len(step_ids))
            offsets, slots = layout.positions.tolist(), layout.logit_slots.tolist()
            rows = zip(runner.texts, runner.n_cached, strict=True)
            return oracle.logits([[after(text, n + offsets[s]) for s in slots] for text, n in rows])

        def commit(runner, layout, picks):
            runner.n_cached = [n + kept for n, (_, kept) in zip(runner.n_cached, picks, strict=True)]
            runner.replay_columns += max(kept for _, kept in picks)

        def select(runner, keep):
            runner.n_cached = [runner.n_cached[i] for i in keep]
            runner.texts = [runner.texts[i] for i in keep]

        DecoderRunner.columns = property(lambda runner: getattr(runner, "replay_columns", 0))
        DecoderRunner.prefill, DecoderRunner.step = prefill, step
        DecoderRunner.commit, DecoderRunner.select = commit, select


def greedy_texts(path: Path, model, tokenizer, names: list[str], n: int, new: int) -> list[dict]:
    """Plain greedy outputs of the first n prompts of each dataset (``datasets.load``), made once
    and kept in ``path``; a prompt the file lacks (another selection, another n) is made and added."""
    kept = json.loads(path.read_text()) if path.exists() else []
    have = {(r["dataset"], r["prompt"]): r for r in kept}
    rows, made = [], 0
    for name in names:
        for prompt in datasets.load(name, n):
            if (name, prompt.id) not in have:
                inputs = datasets.encode(tokenizer, prompt)
                ids = inputs["input_ids"][0].tolist()
                out = model.generate(**inputs, max_new_tokens=new, do_sample=False)
                have[name, prompt.id] = {"dataset": name, "prompt": prompt.id, "ids": ids,
                                         "output": out[0, len(ids) :].tolist()}  # fmt: skip
                made += 1
                print(f"  greedy text {name} {prompt.id}: {len(have[name, prompt.id]['output'])} tokens", flush=True)
            rows.append(have[name, prompt.id])
    if made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(list(have.values())))
    return rows


def policy_options(policy: str) -> tuple[dict, dict]:
    options = dict(POLICIES[policy]) if policy in POLICIES else json.loads(policy)
    return options, options.pop("_drafter", {})


class StepLog:
    """Logs every drafted-or-plain step of a lone sequence (``--losses``): the tree's nodes, the
    tokens it accepted, the longest path of its whole trie along the text, whether it probed and
    what it expected. ``text`` is the replayed prompt + output."""

    def __init__(self, first_token_oracle: bool = False) -> None:
        self.first_token_oracle = first_token_oracle
        self.text: list[int] = []
        self.steps: list[tuple[int, int, int, bool, float]] = []
        self._committed = 0

    def install(self) -> None:
        log, sources, record = self, engine.draft_sources, TreeDrafter.record

        def draft_sources(seq, *args, **kwargs):
            log._committed = len(seq.committed)
            return sources(seq, *args, **kwargs)

        def logged_record(drafter, draft, emitted):
            truth = log.text[log._committed :]
            path = ()
            while draft.trie and len(path) < len(truth) and (*path, truth[len(path)]) in draft.trie.children(path):
                path += (truth[len(path)],)
            log.steps.append((len(draft.buckets), len(emitted) - 1, len(path), draft.probe, draft.expected))
            return record(drafter, draft, emitted)

        engine.draft_sources, TreeDrafter.record = draft_sources, logged_record
        if self.first_token_oracle:
            draft = TreeDrafter.draft

            def told_draft(drafter, *args, **kwargs):
                tree = draft(drafter, *args, **kwargs)
                nxt = log.text[log._committed : log._committed + 1]
                if tree.candidates and nxt and tuple(nxt) not in tree.buckets:  # no first token matches
                    tree = dataclasses.replace(tree, candidates=[], buckets={}, children={}, expected=1.0, probe=False)
                return tree

            TreeDrafter.draft = told_draft


def losses(steps: list[tuple[int, int, int, bool, float]], curve) -> dict:
    """Where the logged steps lost against the clairvoyant's step at the same place (see the
    module docstring), in percent of their cost."""
    total = sum(curve.ratio(1 + k) for k, *_ in steps)
    parts = dict.fromkeys(["failed drafts", "missed", "short", "over-wide", "probes", "other"], 0.0)
    hopeless = failed = 0
    margin = [0.0, 0.0, 0.0]  # expected tokens, emitted tokens, cost of the marginal drafted steps
    for nodes, accepted, best, probe, expected in steps:
        cost = curve.ratio(1 + nodes)
        length = max(range(best + 1), key=lambda n: (1 + n) / curve.ratio(1 + n))
        lost = cost - curve.ratio(1 + length) / (1 + length) * (1 + accepted)
        if probe:
            parts["probes"] += lost
        elif nodes and not accepted:
            parts["failed drafts"] += lost
            failed += 1
            hopeless += best == 0
        elif not nodes and best:
            parts["missed"] += lost
        elif accepted < best:
            parts["short"] += lost
        elif nodes > accepted:
            parts["over-wide"] += lost
        else:  # the tree was the path taken, where a shorter cut paid more per token; or no loss
            parts["other"] += lost
        if nodes and not probe and expected / cost < 1.2:
            margin = [margin[0] + expected, margin[1] + 1 + accepted, margin[2] + cost]
    out = {part: 100 * lost / total if total else 0.0 for part, lost in parts.items()}
    out["all"] = sum(out.values())
    out.update({"failed": failed, "no source matched": hopeless,
                "margin expected": margin[0] / margin[2] if margin[2] else 0.0,
                "margin got": margin[1] / margin[2] if margin[2] else 0.0})  # fmt: skip
    return out


def replay_single(model, oracle: Oracle, rows: list[dict], la: Lookahead, new: int, log: StepLog | None = None):
    out = []
    for row in rows:
        ids, output = row["ids"], row["output"][:new]
        oracle.texts[tuple(ids)] = ids + output
        if log is not None:
            log.text = ids + output
        oracle.cost = 0.0
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        got = model.generate(**inputs, max_new_tokens=new, do_sample=False, custom_generate=la)
        assert got[0, len(ids) :].tolist() == output, f"{row['prompt']}: the replay left the greedy text"
        bounds = clairvoyant_bounds(ids, output, oracle.curve, caps=(7, 3), extra=la.last_candidates[0])
        speedup = (len(output) - 1) / oracle.cost if oracle.cost else 1.0
        out.append({"prompt": row["prompt"], "speedup": speedup, "bound7": bounds[7].speedup,
                    "tokens": len(output) - 1, "cost": oracle.cost or len(output) - 1,
                    "bound3": bounds[3].speedup, "tokens_per_step": la.last_stats.tokens_per_step,
                    "settings": la.last_stats.settings})  # fmt: skip
    return out


def batch_seconds(model, batch: int, rows: int) -> Callable[[int, int, int], float]:
    """Seconds of a step of B sequences x k tokens after C cached columns, from the costs this
    machine stored for the model over batch shapes (``calibration.model_batch_costs``, read as
    ``costs.BatchCosts.seconds`` reads them)."""
    costs = calibration.model_batch_costs(model, check_model(model), batch, rows)
    return lambda size, k, context: costs.seconds(k, size, context)


def replay_batches(model, oracle: Oracle, rows: list[dict], la: Lookahead, new: int, batch: int) -> list[dict]:
    out = []
    for start in range(0, len(rows) - batch + 1, batch):
        group = rows[start : start + batch]
        for row in group:
            oracle.texts[tuple(row["ids"])] = row["ids"] + row["output"][:new]
        longest = max(len(r["ids"]) for r in group)
        ids = torch.tensor([[0] * (longest - len(r["ids"])) + r["ids"] for r in group])
        mask = torch.tensor([[0] * (longest - len(r["ids"])) + [1] * len(r["ids"]) for r in group])
        oracle.cost = 0.0
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             custom_generate=la, pad_token_id=0)  # fmt: skip
        for b, row in enumerate(group):
            output = row["output"][:new]
            assert got[b, longest : longest + len(output)].tolist() == output, f"{row['prompt']}: left the text"
        plain = max(len(r["output"][:new]) for r in group) - 1  # a batch steps until its longest stops
        if oracle.seconds is not None:  # each plain step over the whole batch, after its growing cache
            plain = sum(oracle.seconds(batch, 1, longest + 1 + s) for s in range(plain))
        out.append({"prompts": [r["prompt"] for r in group], "speedup": plain / oracle.cost})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", help="of the greedy texts")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--texts", help="greedy texts, made once (default: results/greedy-texts-...json)")
    parser.add_argument(
        "--curves",
        nargs="+",
        default=["stored"],
        help="named in _curves.CURVES (steep, mid, flat, gpu), or stored / stored-DTYPE (this machine's)",
    )
    parser.add_argument("--policies", nargs="+", default=["auto"])
    parser.add_argument(
        "--price-curve",
        help="the curve the policy prices its steps with (default: each of --curves, which price the replay "
        "and the bound): what a curve that misjudges the machine costs",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--batch-costs",
        action="store_true",
        help="with --batch: choose and price steps in seconds by this machine's stored batch costs",
    )
    parser.add_argument(
        "--laggard-power",
        type=float,
        nargs="+",
        default=[engine.Engine.laggard_power],
        help="with --batch: replay with each (0: every sequence's tokens count alike; see Engine._weights)",
    )
    parser.add_argument("--per-prompt", action="store_true")
    parser.add_argument("--losses", action="store_true", help="where each replay lost against the bound")
    parser.add_argument(
        "--first-token-oracle",
        action="store_true",
        help="what-if: a drafted tree none of whose first tokens is the next one becomes a plain step",
    )
    parser.add_argument("--json", help="write every replay here")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    texts = Path(args.texts or f"results/greedy-texts-{args.model}-{args.dtype}-{args.n}x{args.max_new_tokens}.json")
    rows = greedy_texts(texts, model, tokenizer, args.datasets, args.n, args.max_new_tokens)
    oracle = Oracle(model.config.get_text_config().vocab_size)
    if args.batch_costs:  # measured (once, then stored) by the real model, before the oracle stands in
        for policy in args.policies:
            warm = Lookahead(**policy_options(policy)[0])
            model.generate(torch.ones(args.batch, 8, dtype=torch.long), max_new_tokens=2, custom_generate=warm)
        oracle.seconds = batch_seconds(model, args.batch, 8)
    oracle.install()
    if args.batch_costs and args.batch == 1:
        parser.error("--batch-costs prices batches: give --batch B, B > 1")
    if (args.losses or args.first_token_oracle) and args.batch > 1:
        parser.error("--losses and --first-token-oracle replay lone sequences: leave --batch at 1")
    log = StepLog(args.first_token_oracle) if args.losses or args.first_token_oracle else None
    if log is not None:
        log.install()
    results, lost = [], []
    print("| curve | dataset | policy | modeled speedup (median) | bound, cap 7 | share | bound, cap 3 | tokens/step "
          "| pooled speedup | pooled share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for curve_name in args.curves:
        oracle.curve = _curves.load_curve(curve_name, args.model)
        price = _curves.load_curve(args.price_curve, args.model) if args.price_curve else None
        for name in args.datasets:
            mine = [r for r in rows if r["dataset"] == name][: args.n]
            for policy in args.policies:
                options, drafter = policy_options(policy)
                assembly.TreeDrafter = functools.partial(TreeDrafter, **drafter)
                # one instance per policy and dataset, reused prompt after prompt, as a workload would
                # (--batch-costs: the stored batch costs, as Lookahead() itself reads them)
                curve = None if args.batch_costs else price or oracle.curve
                if args.batch > 1:
                    default = engine.Engine.laggard_power
                    for power in args.laggard_power:
                        engine.Engine.laggard_power = power
                        la = Lookahead(**options, cost_curve=curve, record_candidates=True)
                        runs = replay_batches(model, oracle, mine, la, args.max_new_tokens, args.batch)
                        speed = statistics.median(r["speedup"] for r in runs)
                        every = ", ".join(f"{r['speedup']:.3f}" for r in runs)
                        print(f"| {curve_name} | {name} | {policy} (batch {args.batch}, laggard power {power:g}) | "
                              f"{speed:.3f}x | - | - | - | - | - | - | batches: {every} |", flush=True)  # fmt: skip
                        results.append({"curve": curve_name, "dataset": name, "policy": policy, "batch": args.batch,
                                        "laggard_power": power, "runs": runs})  # fmt: skip
                    engine.Engine.laggard_power = default
                else:
                    la = Lookahead(**options, cost_curve=curve, record_candidates=True)
                    if log is not None:
                        log.steps = []
                    runs = replay_single(model, oracle, mine, la, args.max_new_tokens, log)
                    if log is not None and log.steps:  # only the tree drafter's steps are logged
                        lost.append((curve_name, name, policy, losses(log.steps, oracle.curve)))
                    elif log is not None:
                        print(f"(--losses: {policy} drafted no tree: nothing logged)", file=sys.stderr)
                    speed = statistics.median(r["speedup"] for r in runs)
                    b7 = statistics.median(r["bound7"] for r in runs)
                    b3 = statistics.median(r["bound3"] for r in runs)
                    tps = statistics.mean(r["tokens_per_step"] for r in runs)
                    # pooled over prompts (all tokens / all cost): steadier than a median of 20 when
                    # a change moves a few prompts across the middle
                    tokens = sum(r["tokens"] for r in runs)
                    pooled = tokens / sum(r["cost"] for r in runs)
                    pooled_bound = tokens / sum(r["tokens"] / r["bound7"] for r in runs)
                    share = pooled / pooled_bound
                    print(f"| {curve_name} | {name} | {policy} | {speed:.3f}x | {b7:.3f}x | {speed / b7:.0%} | "
                          f"{b3:.3f}x | {tps:.2f} | {pooled:.3f}x | {share:.0%} |", flush=True)  # fmt: skip
                    if args.per_prompt:
                        for r in runs:
                            share = r["speedup"] / r["bound7"]
                            print(f"|  |  | {r['prompt']} | {r['speedup']:.3f}x | {r['bound7']:.3f}x | {share:.0%} | "
                                  f"{r['bound3']:.3f}x | {r['tokens_per_step']:.2f} |")  # fmt: skip
                    results.append({"curve": curve_name, "dataset": name, "policy": policy, "batch": 1, "runs": runs})
    assembly.TreeDrafter = TreeDrafter
    if lost:
        print("\n| curve | dataset | policy | lost, all | failed drafts | (of them, no source matched) | missed | "
              "short | over-wide | probes | other | marginal drafts: expected / got per unit of cost |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for curve_name, name, policy, part in lost:
            print(f"| {curve_name} | {name} | {policy} | {part['all']:.1f}% | "
                  f"{part['failed drafts']:.1f}% ({part['failed']} steps) | "
                  f"{part['no source matched']} | {part['missed']:.1f}% | {part['short']:.1f}% | "
                  f"{part['over-wide']:.1f}% | {part['probes']:.1f}% | {part['other']:.1f}% | "
                  f"{part['margin expected']:.2f} / {part['margin got']:.2f} |")  # fmt: skip
            results.append({"curve": curve_name, "dataset": name, "policy": policy, "losses": part})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
