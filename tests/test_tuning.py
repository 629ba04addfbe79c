"""Auto-tuning: the chooser's model of the choice, and the cost curve it is built on."""

import json
import os
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import repetitive_prompt, tiny_model

from lookahead import Lookahead, costs
from lookahead.costs import CostCurve, measure
from lookahead.tuning import PLAIN, WidthChooser, match_lengths

# a CPU-like curve: 2 tokens cost 1.1x one, 4 cost 1.9x, 8 cost 2.8x, 16 cost 5x
STEEP = CostCurve(((1, 1.0), (2, 1.1), (4, 1.9), (8, 2.8), (16, 5.0)))
FLAT = CostCurve(((1, 1.0), (64, 1.05)))  # a GPU-like curve: width is nearly free


def test_cost_curve_interpolates_and_extrapolates():
    assert STEEP(1) == 1.0 and STEEP(3) == pytest.approx(1.5) and STEEP(12) == pytest.approx(3.9)
    assert STEEP(24) == pytest.approx(7.2)  # the last segment's slope
    assert STEEP.ratio(2, batch=4) == pytest.approx(2.8 / 1.9)  # a batch of 4 at k=2 is 8 tokens
    # a last segment that falls (a user's curve, or noise) is held flat past it, never reaching 0
    falling = CostCurve.from_points([(1, 0.02), (8, 0.01)])
    assert falling(64) == falling(8) == 0.01


class FakeClock:
    """A clock that only moves when a fake forward pass runs: ``step(k)`` takes ``cost[k]`` times a
    factor that drifts by ``drift`` per pass, plus ``spikes[(k, nth pass of k)]`` extra."""

    def __init__(self, cost, drift=0.0, spikes=None):
        self.cost, self.drift, self.spikes = cost, drift, spikes or {}
        self.now, self.passes, self.calls = 0.0, 0, Counter()

    def __call__(self):
        return self.now

    def step(self, k):
        self.now += self.cost[k] * (1 + self.drift * self.passes) + self.spikes.get((k, self.calls[k]), 0.0)
        self.passes += 1
        self.calls[k] += 1


COST = {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.2}


def test_measure_cancels_a_steady_drift(monkeypatch):
    """A machine slowing down by 5% per pass during the calibration still gives the true ratios:
    every count is timed once going up and once coming down in each pair of rounds."""
    clock = FakeClock(COST, drift=0.05)
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    curve = measure(clock.step, counts=(1, 2, 4, 8), pairs=3)
    for k, cost in COST.items():
        assert curve.ratio(k) == pytest.approx(cost, rel=1e-9)


def test_measure_ignores_a_slow_spell(monkeypatch):
    """One pass 10x slow (the first count's, in one round; or a wide one's) does not move the curve."""
    for spike in ((1, 3), (4, 2)):  # (count, its nth pass; pass 0 is the warm-up)
        clock = FakeClock(COST, spikes={spike: 10.0 * COST[spike[0]]})
        monkeypatch.setattr(costs.time, "perf_counter", clock)
        curve = measure(clock.step, counts=(1, 2, 4, 8), pairs=3)
        assert [k for k, _ in curve.points] == list(COST)
        assert [t for _, t in curve.points] == pytest.approx(list(COST.values()), rel=1e-9)


def test_measure_never_decreases(monkeypatch):
    """Noise can make a wider pass look faster; the curve keeps the slower (earlier) floor."""
    clock = FakeClock({1: 8.0, 2: 6.0, 4: 2.0})  # wider passes faster: a decreasing raw measurement
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    curve = measure(clock.step, counts=(1, 2, 4), pairs=1)
    assert curve.points == ((1, 8.0), (2, 8.0), (4, 8.0))  # clamped to the floor


def test_the_curve_prices_every_draft_length_by_its_own_timing(monkeypatch):
    """A kernel that changes shape between 3 and 4 tokens (fp32 on a 2-core CPU: 1.12x, then
    1.54x) is priced as timed at every count a lone sequence's draft can take (t and up to 7
    drafted tokens), not read off a line between the counts around it (1.29x at 3)."""
    cost = {k: 1.0 + 0.04 * (k - 1) if k <= 3 else 1.5 + 0.05 * (k - 4) for k in range(1, 129)}
    clock = FakeClock(cost)
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    curve = measure(clock.step)  # the calibration's own counts
    for k in range(1, 9):
        assert curve.ratio(k) == pytest.approx(cost[k], rel=1e-9)


def test_match_lengths_follow_the_model():
    # model: after t comes 5, after (5) comes 6, after (5, 6) comes 4; after (5, 9) comes 0
    predict = {(0, 0): 6, (0, 1): 4, (1, 0): 6, (1, 1): 0, (2, 0): 1}
    assert match_lengths([(5, 6, 4), (5, 9, 9), (7, 1)], 5, lambda k, j: predict[(k, j)]) == [3, 1, 0]


def feed(chooser, steps, lengths_for):
    """Run the chooser for ``steps`` steps; ``lengths_for(g, n)`` gives a row's match lengths."""
    choices = []
    for _ in range(steps):
        choice = chooser.choose()
        g, n = choice
        if choice != PLAIN:
            chooser.record(choice, n - 1, lengths_for(g, n)[:g])
        chooser.after_step(choice)
        choices.append(choice)
    return choices


def test_probe_first_then_plain_when_nothing_is_accepted():
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4)
    choices = feed(chooser, 200, lambda g, n: [0] * g)
    assert choices[0] == chooser.probe == (1, 4)  # 4 tokens for 1.9x: the best a probe can do here
    assert choices[1] == PLAIN
    probes = [i for i, c in enumerate(choices) if c != PLAIN]
    assert len(probes) <= 10  # probes back off: 8, 16, 32, 64 steps apart
    assert probes[-1] - probes[-2] == 64


def test_narrow_setting_chosen_when_only_the_first_candidate_helps():
    """Top candidate right 60% of the time for one token: (1, 2) costs 1.1x and yields 1.6."""
    pattern = iter(range(10**6))
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4)
    choices = feed(chooser, 100, lambda g, n: [1 if next(pattern) % 5 < 3 else 0] + [0] * (g - 1))
    assert max(set(choices[1:]), key=choices[1:].count) == (1, 2)


def test_wide_setting_chosen_when_width_is_cheap():
    chooser = WidthChooser(FLAT, max_candidates=4, ngram_size=4)
    assert chooser.probe == (4, 4)
    choices = feed(chooser, 50, lambda g, n: [0, 0, 3, 1][:g])  # only the third candidate helps
    assert set(choices[1:]) == {(3, 4)} or choices.count((3, 4)) > 40


def test_batches_make_width_costlier():
    rate_one = WidthChooser(STEEP, 4, 4, batch=1)
    rate_eight = WidthChooser(STEEP, 4, 4, batch=8)
    for chooser in (rate_one, rate_eight):
        for _ in range(4):  # E = 1.5 at (1, 2)
            chooser.record((4, 4), 3, [1, 0, 0, 0])
            chooser.record((4, 4), 3, [0, 0, 0, 0])
    assert rate_one.rate(1, 2) > 1.0 > rate_eight.rate(1, 2)


def test_disabled_chooser_runs_the_configured_setting():
    chooser = WidthChooser(None, max_candidates=3, ngram_size=5, enabled=False)
    assert feed(chooser, 5, lambda g, n: [0] * g) == [(3, 5)] * 5


def test_auto_settings_report_their_choice_and_stay_exact():
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 4)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    lookahead = Lookahead()
    got = model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=lookahead)
    assert got.tolist() == expected.tolist()
    stats = lookahead.last_stats
    assert sum(stats.settings.values()) == stats.steps - 1  # every step after the prefill
    assert stats.as_dict()["settings"] == stats.settings
    assert all(key == "plain" or key.startswith("G=") for key in stats.settings)


def test_context_lookup_proposes_the_repeated_text():
    """On a prompt that repeats a motif, the longest-suffix lookup makes nearly every step
    accept a full n-gram."""
    model = tiny_model("gpt_neox")
    prompt = repetitive_prompt(36, 2)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    with_lookup, without = Lookahead(0, 4, 1), Lookahead(0, 4, 1, context_lookup=False, pool_from_output=False)
    for lookahead in (with_lookup, without):
        got = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
    assert with_lookup.last_stats.tokens_per_step > without.last_stats.tokens_per_step


def test_probes_are_rarer_where_they_cost_more():
    """A losing probe may add at most ~10% to plain decoding's time: in a batch of 8 a (1,4) probe
    costs 3.4 plain steps, so probes come at least 24 steps apart."""
    one, eight = WidthChooser(STEEP, 4, 4, batch=1), WidthChooser(STEEP, 4, 4, batch=8)
    gaps = {}
    for name, chooser in (("one", one), ("eight", eight)):
        probes = [i for i, c in enumerate(feed(chooser, 60, lambda g, n: [0] * g)) if c != PLAIN]
        gaps[name] = probes[1] - probes[0]
    assert gaps["one"] == 9 and gaps["eight"] >= 24


def test_token_tree_sizes_make_shared_candidates_affordable():
    """Candidates (5,6,7), (5,6,8), (5,6,9), (5,6,1), where only the fourth has been going all the
    way: on rows of their own, 4 candidates of 3 tokens are 13 tokens (4.2x a plain step on
    STEEP) and lose to plain decoding; as a tree they are 7 tokens (2.6x) for 4 tokens and win."""
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4)
    for _ in range(8):
        chooser.record((4, 4), 3, [0, 0, 0, 3])
    chains = {(g, n): (chooser.rows(g, n), g) for g, n in chooser.options()}
    # as a tree: cut to 2 tokens they are all (5, 6), to 1 token all (5,)
    tree = {(g, n): {4: (3 + g, g), 3: (3, 1), 2: (2, 1)}[n] for g, n in chooser.options()}
    assert chooser.choose(sizes=chains) == PLAIN
    assert chooser.choose(sizes=tree) == (4, 4)
    assert chooser.rate(4, 4) == pytest.approx(4 / STEEP(7))
    assert chooser.rate(2, 3) == pytest.approx(1 / STEEP(3))  # one candidate at hand, and it fails


def test_no_candidate_at_hand_is_a_plain_step():
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4)
    for _ in range(8):  # everything accepted before
        chooser.record((4, 4), 3, [3, 3, 3, 3])
    none = {(g, n): (1, 0) for g, n in chooser.options()}  # but no candidate now
    assert chooser.choose(sizes=none) == PLAIN
    assert chooser.rate(4, 4) == 1.0


@given(
    st.lists(
        st.tuples(st.sampled_from([None, 0, 1, 2, 3]), st.integers(1, 3), st.lists(st.integers(0, 3), max_size=4)),
        max_size=40,
    ),
    st.sampled_from([None, 0, 1, 2, 3]),
)
def test_expected_tokens_is_the_mean_over_the_matching_observations(observed, match):
    """The tallies kept as observations come and go give the mean over the last ``memory``
    observations of the bucket, drawn towards the mean of all of them."""
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4, memory=16)
    for m, cap, lengths in observed:
        chooser.record((4, 4), cap, [min(a, cap) for a in lengths], m)
    kept = [(m, cap, [min(a, cap) for a in lengths]) for m, cap, lengths in observed if lengths][-16:]

    def mean(observations, g, n):
        return sum(1 + min(n - 1, cap, max(a[:g], default=0)) for _, cap, a in observations) / len(observations)

    for g in range(0, 5):
        for n in range(2, 5):
            bucket = [o for o in kept if o[0] == match] if match is not None else []
            if not kept or g == 0:
                want = 1.0
            elif not bucket:
                want = mean(kept, g, n)
            else:  # the bucket's mean, drawn towards the overall one with the weight of 2 observations
                want = (mean(bucket, g, n) * len(bucket) + mean(kept, g, n) * 2) / (len(bucket) + 2)
            assert chooser.expected_tokens(g, n, match) == pytest.approx(want)


def test_text_turning_repetitive_is_probed_again_soon():
    """Probes that lost after new tokens (match length 0) back off to every 64 steps; once the
    context repeats a 3-token suffix, the next probe comes after the usual spacing, and one win
    there is enough to go wide while the text keeps repeating."""
    chooser = WidthChooser(STEEP, max_candidates=4, ngram_size=4)

    def run(steps, match, lengths_for):
        choices = []
        for _ in range(steps):
            choice = chooser.choose((match,))
            if choice != PLAIN:
                chooser.record(choice, choice[1] - 1, lengths_for(*choice)[: choice[0]], match)
            chooser.after_step(choice)
            choices.append(choice)
        return choices

    first = run(200, 0, lambda g, n: [0] * g)
    probes = [i for i, c in enumerate(first) if c != PLAIN]
    assert probes[-1] - probes[-2] == 64
    repetitive = run(40, 3, lambda g, n: [n - 1] + [0] * (g - 1))
    first_probe = next(i for i, c in enumerate(repetitive) if c != PLAIN)
    assert first_probe <= 10  # the (1,4) probe's budget on STEEP: ceil(0.9 / 0.1)
    assert all(c != PLAIN for c in repetitive[first_probe:])


CROSS_PROCESS = """
import sys
import torch
sys.path.insert(0, {tests!r})
from tiny_models import repetitive_prompt, tiny_model
import lookahead.costs as costs
from lookahead import Lookahead
if "--forbid-measure" in sys.argv:
    def refuse(*args, **kwargs):
        raise SystemExit("the cost curve was measured again")
    costs.measure = refuse
torch.set_num_threads(2)
model = tiny_model("llama")
torch.manual_seed(2)
lookahead = Lookahead()
out = model.generate(repetitive_prompt(24, 2), do_sample=True, temperature=0.8, max_new_tokens=40,
                     custom_generate=lookahead)
print(out[0].tolist(), lookahead.last_stats.settings)
"""


def test_sampled_text_is_the_same_in_every_process(tmp_path):
    """The cost curve decides step shapes: it is measured once, stored, and read back by the next
    process, which then takes the same steps and samples the same text for the same seed (without
    the stored curve that process would have to time its own, and in bf16 other step shapes can
    tip a draw's near-tie)."""
    import subprocess
    import sys
    from pathlib import Path

    script = CROSS_PROCESS.format(tests=str(Path(__file__).parent))
    env = {**__import__("os").environ, "LOOKAHEAD_CACHE": str(tmp_path / "cache")}
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    first = run()
    assert first.returncode == 0, first.stderr
    second = run("--forbid-measure")  # must read the stored curve
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout and "G=" in first.stdout
    env["LOOKAHEAD_CACHE"] = str(tmp_path / "empty")
    assert run("--forbid-measure").returncode != 0  # an empty cache would have re-timed it


def test_a_given_cost_curve_decides_the_steps():
    model, prompt = tiny_model("llama"), repetitive_prompt(24, 1)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    flat, steep = [(1, 1.0), (2, 1.0), (8, 1.0), (32, 1.0)], [(1, 1.0), (2, 50.0), (8, 200.0)]
    wide, plain = Lookahead(cost_curve=flat), Lookahead(cost_curve=steep)
    for lookahead in (wide, plain):
        got = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
    assert wide.last_stats.wide_steps > plain.last_stats.wide_steps
    with pytest.raises(ValueError, match="tokens increasing from 1"):
        Lookahead(cost_curve=[(2, 1.0), (1, 2.0)])
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="positive and finite"):
            Lookahead(cost_curve=[(1, 1.0), (8, bad)])


def _batch_costs(near: dict, far: dict) -> costs.BatchCosts:
    """Batch costs measured at 2 and 8 sequences after 64 and 512 cached columns: ``near[B]`` and
    ``far[B]`` are T_B(k) at 64 and 512 for k = 1, 2, 4."""
    curve = lambda seconds: CostCurve(tuple(zip((1, 2, 4), seconds, strict=True)))  # noqa: E731
    return costs.BatchCosts(STEEP, tuple((b, ((64, curve(near[b])), (512, curve(far[b])))) for b in (2, 8)))


def test_batch_costs_interpolate_over_batch_sizes_and_cache_lengths():
    costs = _batch_costs({2: (1.0, 1.2, 1.4), 8: (2.0, 3.0, 4.0)}, {2: (2.0, 3.0, 4.0), 8: (4.0, 8.0, 12.0)})
    assert costs.ratio(2, 2, 64) == pytest.approx(1.2) and costs.ratio(4, 8, 64) == pytest.approx(2.0)
    assert costs.ratio(2, 2, 10) == pytest.approx(1.2)  # below the shortest cache: its costs
    assert costs.ratio(2, 8, 512) == pytest.approx(2.0)
    # seconds linear in the cache length, then their ratio: halfway, T(2) = 5.5, T(1) = 3
    assert costs.ratio(2, 8, 288) == pytest.approx(5.5 / 3.0)
    assert costs.ratio(2, 8, 960) == pytest.approx(13.0 / 6.0)  # beyond the longest: extrapolated
    # between batch sizes, the ratio is interpolated: B = 5 is halfway between 2 and 8
    assert costs.ratio(4, 5, 64) == pytest.approx((1.4 + 2.0) / 2)
    assert costs.ratio(2, 1, 64) == STEEP.ratio(2)  # one sequence: the single curve
    assert costs.ratio(2, 16, 64) == pytest.approx(1.5)  # beyond the largest batch: its ratio


def test_a_batch_is_priced_by_its_measured_costs_not_the_single_curve():
    """The single curve says a batch of 8 verifying (1, 4) costs next to nothing (FLAT); measured
    batch costs say such a step costs 1.2x a plain one after a short cache and 3x after a long
    one: with 2.5 tokens expected per sequence, it pays in the first case only."""
    costs = _batch_costs({2: (1.0, 1.1, 1.2), 8: (1.0, 1.1, 1.2)}, {2: (1.0, 2.0, 3.0), 8: (1.0, 2.0, 3.0)})
    chooser = WidthChooser(FLAT, 1, 4, batch=8)
    for _ in range(20):
        chooser.record((1, 4), 3, [3])
        chooser.record((1, 4), 3, [0])
    assert chooser.rate(1, 4) == pytest.approx(2.5 / FLAT.ratio(4, 8))
    chooser.batch_costs = costs
    chooser.context = 64
    assert chooser.rate(1, 4) == pytest.approx(2.5 / 1.2) and chooser.best() != PLAIN
    chooser.context = 512
    assert chooser.rate(1, 4) == pytest.approx(2.5 / 3.0) and chooser.best() == PLAIN
    chooser.batch = 1  # a lone sequence: the single curve
    assert chooser.rate(1, 4) == pytest.approx(2.5 / FLAT.ratio(4))


def test_batch_curve_is_measured_once_and_only_extended_after(tmp_path, monkeypatch):
    """A batch's costs are stored like the single curve: read back, not timed again; a wider
    setting times only the counts it adds, in the stored curve's units, and keeps the rest."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_curves", {})
    model = tiny_model("llama")
    timed = []

    def make_step(scale):
        def step(k):
            timed.append(k)
            clock.now += scale * (1 + 0.25 * (k - 1))

        return lambda: step

    clock = FakeClock({})
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    first = costs.batch_curve(model, 4, 64, 3, make_step(1.0))
    assert [k for k, _ in first.points] == [1, 2, 3]  # the grid up to the first count >= 3
    assert first.ratio(3) == pytest.approx(1.5)
    key = f"{costs.curve_key(model)}|batch-4|context-64"
    assert key in costs._read_disk()
    monkeypatch.setattr(costs, "_curves", {})  # as a new process: from disk
    timed.clear()
    assert costs.batch_curve(model, 4, 64, 2, make_step(1.0)) == first and not timed
    wider = costs.batch_curve(model, 4, 64, 7, make_step(2.0))  # a machine twice as slow now
    assert set(timed) == {1, 4, 6, 8}  # the new counts up to the first >= 7, and 1 to scale them by
    assert wider.points[:3] == first.points
    assert wider.ratio(8) == pytest.approx(2.75) and wider(8) == pytest.approx(2.75 * first(1))


def test_generate_prices_a_batch_by_its_stored_batch_costs(tmp_path, monkeypatch):
    """``Lookahead()`` on a batch reads the batch costs stored for the model (never timing them
    again) and decides by them, at the batch's cache length: costs that make every wide step a
    loss leave a repetitive batch on plain steps, costs that make width free let it verify, and
    costs free after a short cache but dear after a long one tell a short batch from a long one.
    A given ``cost_curve`` prices the batch by that curve alone. The outputs never change."""
    import json

    from lookahead.calibration import _context
    from lookahead.support import check_model

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    model = tiny_model("llama")
    key, spec = costs.curve_key(model), check_model(model)
    near, far = sorted({_context(spec, length) for length in costs.BATCH_CONTEXTS})
    assert (near, far) == (64, 128)  # the tiny model's 512 positions shorten the longer one
    free, dear = (lambda k: 1.0), (lambda k: 1.0 if k == 1 else 50.0 * k)

    def wide_steps(prompt_length, at_near, at_far, lookahead=None):
        data = {key: [[1, 1.0], [128, 1.0]]}
        for context, seconds in ((near, at_near), (far, at_far)):
            data[f"{key}|batch-2|context-{context}"] = [[k, seconds(k)] for k in costs.ROW_GRID]
        (tmp_path / "cost-curves.json").write_text(json.dumps(data))
        monkeypatch.setattr(costs, "_curves", {})
        prompts = torch.cat([repetitive_prompt(prompt_length, 1), repetitive_prompt(prompt_length, 2)])
        expected = model.generate(prompts, max_new_tokens=30, do_sample=False)
        lookahead = lookahead or Lookahead()
        got = model.generate(prompts, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
        return lookahead.last_stats.wide_steps

    def forbid(*args, **kwargs):
        raise AssertionError("a stored curve was timed again")

    monkeypatch.setattr(costs, "measure", forbid)
    assert wide_steps(24, free, free) >= 5
    assert wide_steps(24, dear, dear) <= 1  # the first probe at most
    assert wide_steps(24, free, dear) >= 5  # 24-54 cached columns: the costs after 64
    assert wide_steps(140, free, dear) <= 1  # 140-170: past the costs after 128
    assert wide_steps(24, dear, dear, Lookahead(cost_curve=[(1, 1.0), (128, 1.0)])) >= 5


def test_batch_rows_without_candidates_count_one_token():
    """In a batch of 4 where candidates always match fully but only one row has any at hand, a
    wide step yields (4 + 1 + 1 + 1) / 4 = 1.75 tokens per row, not 4: with FLAT's cost it still
    pays, with a cost of 2x per row it no longer does."""
    costly = CostCurve(((1, 1.0), (4, 1.0), (16, 2.0)))  # T(4 rows x 4 tokens) = 2 T(4 rows x 1)
    for curve, pays in ((FLAT, True), (costly, False)):
        chooser = WidthChooser(curve, max_candidates=1, ngram_size=4, batch=4)
        for _ in range(8):
            chooser.record((1, 4), 3, [3])
        assert chooser.rate(1, 4, [0] * 4) == pytest.approx(4 / curve.ratio(4, 4))  # every row has one
        chooser.choose([0] * 4, at_hand=[1, 0, 0, 0])
        assert chooser.rate(1, 4, [0] * 4) == pytest.approx(1.75 / curve.ratio(4, 4))
        assert (chooser.best([0] * 4) != PLAIN) == pays
    chooser.choose([0] * 4, at_hand=[0, 0, 0, 0])  # nothing at hand anywhere: a plain step
    assert chooser.available(1, 4) == 0


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_the_calibration_runs_without_autograd(arch, tmp_path, monkeypatch):
    """The bench and the server ask for the curve outside generate, where autograd is on: the
    calibration must not record graphs (timed with them, wide passes cost 1.3-2x what decoding
    pays, and the curve is stored for good), and it is stored under the current calibration."""
    from tiny_models import tiny_seq2seq

    from lookahead.calibration import model_cost_curve

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    model = tiny_seq2seq(arch) if arch == "t5" else tiny_model(arch)
    grad_modes, real_measure = [], costs.measure

    def watched(step, **kwargs):
        def step_and_look(k):
            grad_modes.append(torch.is_grad_enabled())
            step(k)

        return real_measure(step_and_look, counts=(1, 2, 4), pairs=1)

    monkeypatch.setattr(costs, "measure", watched)
    monkeypatch.setattr(costs, "_curves", {})
    with torch.enable_grad():
        curve = model_cost_curve(model)
        assert torch.is_grad_enabled()  # the caller's mode is left as it was
    assert grad_modes and not any(grad_modes)
    assert [k for k, _ in curve.points] == [1, 2, 4]
    assert costs.CALIBRATION in costs.curve_key(model)
    assert costs._read_disk().keys() == {costs.curve_key(model)}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_batch_costs_are_timed_on_batched_steps_under_a_mask(arch, tmp_path, monkeypatch):
    """The batch calibration runs B sequences of k tokens each, without autograd, and (decoder-only)
    under a 4D mask at every count, a plain step included, since a batch's cache holds holes; its
    curves are stored per batch size and cache length (one length where the position table is
    short: GPT-2's 256 positions leave 64 for both)."""
    from tiny_models import tiny_seq2seq

    from lookahead.calibration import model_batch_costs
    from lookahead.support import check_model

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_curves", {})
    model = tiny_seq2seq(arch) if arch == "t5" else tiny_model(arch)
    seen = []

    def look(module, args, kwargs):
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        mask = kwargs.get("attention_mask")
        seen.append((tuple(ids.shape), None if mask is None else mask.dim(), torch.is_grad_enabled()))

    handle = model.register_forward_pre_hook(look, with_kwargs=True)
    try:
        with torch.enable_grad():
            measured = model_batch_costs(model, check_model(model), 3, 4)
    finally:
        handle.remove()
    contexts = [64] if arch == "gpt2" else [64, 128] if arch == "llama" else [64, 512]
    assert [size for size, _ in measured.by_batch] == [2, 4]
    assert [[length for length, _ in curves] for _, curves in measured.by_batch] == [contexts, contexts]
    assert all(len(curve.points) == 4 for _, curves in measured.by_batch for _, curve in curves)  # k = 1..4
    assert not any(grad for *_, grad in seen)
    steps = [(shape, dim) for shape, dim, _ in seen if shape[0] > 1 and shape[1] <= 4]  # prefills: longer
    assert {shape for shape, _ in steps} == {(b, k) for b in (2, 4) for k in (1, 2, 3, 4)}
    if arch != "t5":
        assert {dim for _, dim in steps} == {4}
    stored = costs._read_disk().keys()
    assert {f"{costs.curve_key(model)}|batch-{b}|context-{c}" for b in (2, 4) for c in contexts} <= stored


def test_weights_decide_whose_tokens_a_batch_step_is_for():
    """The same observations (rows after a 3-token repeated suffix accept all 3 candidate tokens,
    rows after a new token none) and the same batch of two, one of each: a wide step at 2x a
    plain one pays for the mean of the two rows; weighted towards the row that gains nothing it
    does not, weighted towards the row that gains it does."""
    curve = CostCurve(((1, 1.0), (2, 1.0), (8, 2.0)))  # 2 rows x 4 tokens: 2x 2 rows x 1
    chooser = WidthChooser(curve, max_candidates=1, ngram_size=4, batch=2)
    for _ in range(20):
        chooser.record((1, 4), 3, [3], match=3)
        chooser.record((1, 4), 3, [0], match=0)
    rows = [3, 0]
    assert chooser.choose(rows, at_hand=[1, 1]) == (1, 4)
    assert chooser.choose(rows, at_hand=[1, 1], weights=[1.0, 1.0]) == (1, 4)  # alike: the same
    assert chooser.choose(rows, at_hand=[1, 1], weights=[0.1, 1.0]) == PLAIN
    assert chooser.choose(rows, at_hand=[1, 1], weights=[1.0, 0.1]) == (1, 4)
    unweighted = (chooser.expected_tokens(1, 4, 3) + chooser.expected_tokens(1, 4, 0)) / 2
    chooser.choose(rows, at_hand=[1, 1])
    assert chooser.rate(1, 4, rows) == pytest.approx(unweighted / 2.0)


def test_generate_weighs_a_batch_by_the_tokens_each_sequence_has_left(monkeypatch):
    """``generate`` waits for its whole batch, so each step of a batch weighs a sequence's tokens
    by (tokens it may still emit / the most any may) ** 4: alike while the sequences are abreast,
    the one furthest behind at 1 once they part. Outputs are unchanged."""
    from lookahead import engine

    seen = []
    choose = WidthChooser.choose

    def spy(self, matches=(None,), sizes=None, at_hand=None, weights=None):
        if len(matches) > 1:  # the last sequence alone has nobody to be weighed against
            seen.append(weights)
        return choose(self, matches, sizes, at_hand, weights)

    monkeypatch.setattr(WidthChooser, "choose", spy)
    lefts = []
    weights_of = engine.Engine._weights

    def spy_weights(self, active, limits):
        lefts.append([limit - seq.length for seq, limit in zip(active, limits, strict=True)])
        return weights_of(self, active, limits)

    monkeypatch.setattr(engine.Engine, "_weights", spy_weights)
    model = tiny_model("llama")
    varied = torch.randint(3, 60, (1, 24), generator=torch.Generator().manual_seed(5))
    prompts = torch.cat([repetitive_prompt(24, 1), varied])
    expected = model.generate(prompts, max_new_tokens=40, do_sample=False)
    got = model.generate(prompts, max_new_tokens=40, do_sample=False, custom_generate=Lookahead())
    assert got.tolist() == expected.tolist()
    assert seen and len(seen) == len(lefts)
    assert seen[0] == [1.0, 1.0]  # both start 40 tokens from their end
    for weights, left in zip(seen, lefts, strict=True):
        assert weights == pytest.approx([(n / max(left)) ** 4 for n in left])
    assert any(len(set(left)) > 1 for left in lefts)  # the sequences parted: weights told them apart


def test_processes_storing_curves_at_once_lose_none(tmp_path):
    """Two processes (two servers starting, a bench beside a server) each add their curves to the
    one cost-curves.json: a read-modify-write without a lock lost a quarter of them."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lookahead import costs\n"
        "for i in range(200):\n"
        "    costs._write_disk(f'{sys.argv[1]}-{i}', costs.CostCurve(((1, 1.0), (2, 1.0 + i))))\n"
    )
    env = {**os.environ, "LOOKAHEAD_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script, name], env=env) for name in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    stored = json.loads((tmp_path / "cost-curves.json").read_text())
    assert sorted(stored) == sorted(f"{name}-{i}" for name in "ab" for i in range(200))
