"""What-if: should a lone sequence's drafts be priced at its cache length?

The cost curve is timed after 64 cached tokens; the issue-14 runs decode after about 100 to 600.
This replays ``Lookahead()``'s drafting over the stored greedy texts (``draft_replay.py``'s oracle
in place of the model) with every step priced by what it would cost at the step's cache length:
T(k)/T(1) interpolated between the stored curve's and that of a curve timed after 512 cached tokens
(linear in the cache length, extrapolated past 512). The drafter is priced either by the stored curve, as
``Lookahead()`` is, or by that same cost at its cache length. A third replay prices every step
with the stored curve, as ``draft_replay.py`` and the bench's bound do.

    .venv/bin/python benchmarks/context_cost_replay.py --dtype float16

Needs the greedy texts of ``draft_replay.py`` (made on the first run) and the model's stored curve
in DTYPE; the curve after 512 tokens is timed once and kept in results/cost-after-512-DTYPE.json.
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

sys.path.insert(0, str(Path(__file__).parent))
import draft_replay  # noqa: E402
import policy_share  # noqa: E402

from lookahead import Lookahead, calibration, costs, models  # noqa: E402
from lookahead.drafting import TreeDrafter  # noqa: E402
from lookahead.runner import DecoderRunner  # noqa: E402
from lookahead.support import check_model  # noqa: E402

FAR = 512  # cached tokens of the second curve


def curve_after(dtype: str, model_name: str) -> costs.CostCurve:
    """The model's cost curve timed after FAR cached tokens, once, then read back."""
    path = Path(f"results/cost-after-{FAR}-{dtype}.json")
    if path.exists():
        return costs.CostCurve(tuple((int(k), float(s)) for k, s in json.loads(path.read_text())))
    model, _ = models.load(model_name, dtype=dtype)
    with torch.no_grad():
        curve = costs.measure(calibration._calibration_step(model, check_model(model), 1, FAR), counts=costs.GRID)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve.points))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", help="whose curves price the steps")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    near, far = policy_share.load_curve(f"stored-{args.dtype}", args.model), curve_after(args.dtype, args.model)
    print("T(k)/T(1) at k =", [k for k, _ in near.points])
    print("  after 64: ", [round(near.ratio(k), 3) for k, _ in near.points])
    print(f"  after {FAR}:", [round(far.ratio(k), 3) for k, _ in far.points])

    @functools.lru_cache(None)
    def cost_at(bucket: int) -> costs.CostCurve:  # T(k)/T(1) after bucket * 16 cached tokens
        # ratios, not seconds: the stored curve and the one after FAR were timed on different days
        share = max(0.0, (bucket * 16 - 64) / (FAR - 64))
        ratios = [(k, near.ratio(k), far.ratio(k)) for k, _ in near.points]
        return costs.CostCurve(tuple((k, n + max(0.0, f - n) * share) for k, n, f in ratios))

    model, tokenizer = models.load(args.model, dtype="bfloat16")  # the texts are bf16 greedy's
    texts = Path(f"results/greedy-texts-{args.model}-bfloat16-{args.n}x{args.max_new_tokens}.json")
    names = ["humaneval", "mtbench"]
    rows = draft_replay.greedy_texts(texts, model, tokenizer, names, args.n, args.max_new_tokens)
    oracle = draft_replay.Oracle(model.config.get_text_config().vocab_size)
    oracle.install()
    state = {"cached": 0, "steps_at_context": True, "drafter_at_context": False}
    prefill, commit, step, draft = DecoderRunner.prefill, DecoderRunner.commit, DecoderRunner.step, TreeDrafter.draft

    def prefill_tracked(runner, prompts):
        out = prefill(runner, prompts)
        state["cached"] = runner.n_cached[0]
        return out

    def commit_tracked(runner, layout, picks):
        commit(runner, layout, picks)
        state["cached"] = runner.n_cached[0]

    def step_priced(runner, layout, step_ids):
        oracle.curve = cost_at(state["cached"] // 16) if state["steps_at_context"] else near
        return step(runner, layout, step_ids)

    def draft_priced(drafter, *args, **kwargs):
        if state["drafter_at_context"]:
            drafter.curve = cost_at(state["cached"] // 16)
        return draft(drafter, *args, **kwargs)

    DecoderRunner.prefill, DecoderRunner.commit, DecoderRunner.step = prefill_tracked, commit_tracked, step_priced
    TreeDrafter.draft = draft_priced
    print("| steps priced | drafter priced | dataset | modeled speedup (median) | pooled |")
    print("|---|---|---|---|---|")
    for steps_at, drafter_at in ((False, False), (True, False), (True, True)):
        state["steps_at_context"], state["drafter_at_context"] = steps_at, drafter_at
        for name in names:
            mine = [r for r in rows if r["dataset"] == name][: args.n]
            lookahead = Lookahead(cost_curve=near, record_candidates=True)  # one per workload
            runs = draft_replay.replay_single(model, oracle, mine, lookahead, args.max_new_tokens)
            median = statistics.median(r["speedup"] for r in runs)
            pooled = sum(r["tokens"] for r in runs) / sum(r["cost"] for r in runs)
            where = lambda at: "at the cache length" if at else "after 64 (stored)"  # noqa: E731
            print(f"| {where(steps_at)} | {where(drafter_at)} | {name} | {median:.3f}x | {pooled:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
