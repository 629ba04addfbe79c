"""Count-based drafting (lookahead.drafting): the trie, the tree it drafts, what it learns, probes.

Pure tests with hand-made cost curves and sources, then the invariant on tiny models: the drafted
steps keep the output identical to model.generate.
"""

import pytest
from tiny_models import CONFIGS, repetitive_prompt, tiny_model

from lookahead import Lookahead
from lookahead.costs import CostCurve
from lookahead.drafting import PRIORS, TreeDrafter, Trie, span_band
from lookahead.lookup import ContextIndex
from lookahead.support import check_model
from lookahead.tuning import PLAIN

FLAT = CostCurve(((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.2), (16, 1.4), (32, 2.0)))  # width nearly free
STEEP = CostCurve(((1, 1.0), (2, 2.25), (4, 3.0), (8, 4.8), (16, 7.7)))  # a slow CPU in bf16

# the module docstring's example: "a b" occurred three times, followed by c d e, c d e and c f
EXAMPLE = [(2, (3, 4, 5)), (2, (3, 4, 5)), (2, (3, 6))]


def _made(trie, parent=()):
    """Every node of the trie below ``parent``, made by asking for children."""
    nodes = []
    for child in trie.children(parent):
        nodes += [child, *_made(trie, child)]
    return nodes


def test_trie_counts_each_occurrence_through_each_node():
    trie = Trie([*EXAMPLE, (0, (7, 8))], cap=3)
    assert trie.occurrences == 3  # the pool's n-gram (level 0) is no occurrence
    assert trie.children(()) == [(3,), (7,)] and trie.children((3,)) == [(3, 4), (3, 6)]
    assert {p: trie.evidence(p) for p in _made(trie)} == {
        (3,): (3, 2),
        (3, 4): (2, 2),
        (3, 4, 5): (2, 2),
        (3, 6): (1, 2),
        (7,): (0, 0),
        (7, 8): (0, 0),
    }
    # (level band, first token, support up to 3, unanimous: all the parent's occurrences go on here)
    assert trie.buckets[(3,)] == (2, True, 3, True) and trie.buckets[(3, 4)] == (2, False, 2, False)
    assert trie.buckets[(3, 4, 5)] == (2, False, 2, True) and trie.buckets[(7,)] == (0, True, 0, False)
    assert _made(Trie(EXAMPLE, cap=1)) == [(3,)]  # cut to the cap
    assert _made(Trie(EXAMPLE, cap=0)) == [] and _made(Trie([(1, ())], cap=3)) == []


def test_trie_makes_only_the_nodes_asked_for():
    trie = Trie(EXAMPLE, cap=3)
    trie.children(())
    assert set(trie.buckets) == {(3,)}  # the children of (3,) are not made until asked for
    trie.children((3,))
    assert set(trie.buckets) == {(3,), (3, 4), (3, 6)}


def test_occurrences_count_each_earlier_place_once_at_its_longest_suffix():
    index = ContextIndex(max_suffix=3)
    text = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    index.extend(text)
    # "1 2 3" ended at 2 (level 3), "2 3" also at 6 (level 2); "3" adds nothing new
    assert index.occurrences(text, 2) == [(3, (9, 5)), (2, (7, 1))]


def test_occurrences_report_how_far_back_the_context_matches_up_to_the_reach():
    index = ContextIndex(max_suffix=3)
    #       0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    text = [4, 1, 2, 3, 9, 5, 8, 2, 3, 7, 4, 1, 2, 3]
    index.extend(text)
    # "1 2 3" ended at 3, and "4 1 2 3" matches there too (4 back); "2 3" also ended at 8
    assert index.occurrences(text, 2) == [(3, (9, 5)), (2, (7, 4))]
    assert index.occurrences(text, 2, reach=8) == [(4, (9, 5)), (2, (7, 4))]
    assert index.occurrences(text, 2, reach=4) == [(4, (9, 5)), (2, (7, 4))]
    assert index.occurrences(text, 2, reach=3) == [(3, (9, 5)), (2, (7, 4))]
    # a span running back to the text's first token stops there
    text = [1, 2, 3, 6, 1, 2, 3]
    index = ContextIndex(max_suffix=3)
    index.extend(text)
    assert index.occurrences(text, 1, reach=32) == [(3, (6,))]


def test_an_occurrence_running_into_the_present_continues_with_its_period():
    """The newest occurrences of a run or a repeated line lie just behind the end of the text; what
    followed them is cut short by it. Since the context matches there, the text is predicted to
    repeat with that period, so the candidate still has the full length (the index keeps only the
    newest few occurrences, so older ones cannot make up for it)."""
    index = ContextIndex(max_suffix=3)
    #       0  1  2  3  4  5  6  7  8
    text = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    index.extend(text)
    # "3 1 2" ended at 5 (3 back): 3 1 2 follow it, then the period goes on; "1 2" also at 1
    assert index.occurrences(text, 5) == [(3, (3, 1, 2, 3, 1)), (2, (3, 1, 2, 3, 1))]
    run = [4, 5, 5, 5, 5, 5, 5]
    index = ContextIndex(max_suffix=3, per_key=2)
    index.extend(run)
    assert index.occurrences(run, 4) == [(3, (5, 5, 5, 5))]  # the newest kept place: 1 token back


def test_span_bands():
    assert [span_band(s) for s in (0, 1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 2, 3, 4, 4, 8, 8, 16, 16]


def test_long_spans_learn_their_own_rate_apart_from_short_ones():
    """A copy of a long span and a chance 3-token match have their own buckets: after the model
    accepts the one and rejects the other, only the long span's continuation is drafted."""
    curve = CostCurve(((1, 1.0), (2, 1.5), (4, 2.0), (8, 3.0)))
    drafter = TreeDrafter(curve, max_nodes=3, max_leaves=1, probe_every=10**6)
    for _ in range(30):
        long = drafter.draft([(20, (3, 4, 5))], cap=3)
        drafter.record(long, [3, 4, 5, 6])
        short = drafter.draft([(3, (7, 8, 9))], cap=3)
        drafter.record(short, [1])
    assert drafter.draft([(20, (3, 4, 5))], cap=3).candidates == [(3, 4, 5)]
    assert drafter.draft([(3, (7, 8, 9))], cap=3).candidates == []
    assert drafter.rate((16, True, 1, True), 0.5) > 0.9 > 0.2 > drafter.rate((3, True, 1, True), 0.5)


def test_strong_evidence_on_cheap_width_drafts_the_whole_tree():
    drafter = TreeDrafter(FLAT, max_nodes=12, max_leaves=4)
    draft = drafter.draft(EXAMPLE, cap=3)
    assert sorted(draft.candidates) == [(3, 4, 5), (3, 6)]
    assert set(draft.buckets) == {(3,), (3, 4), (3, 4, 5), (3, 6)}
    assert draft.children[()] == [(3,)] and sorted(draft.children[(3,)]) == [(3, 4), (3, 6)]
    assert 2.0 < draft.expected < 4.0


def test_dear_width_and_weak_evidence_step_plain():
    drafter = TreeDrafter(STEEP, max_nodes=12, max_leaves=4)
    draft = drafter.draft([(1, (3, 4)), (0, (5, 6))], cap=3)
    assert draft.candidates == [] and drafter.chosen[PLAIN] == 1


def test_caps_on_nodes_leaves_and_length_hold():
    sources = [(1, (k, k + 1, k + 2, k + 3)) for k in range(10, 60, 10)]  # five distinct branches
    drafter = TreeDrafter(FLAT, max_nodes=6, max_leaves=2)
    draft = drafter.draft(sources, cap=3)
    assert len(draft.candidates) <= 2 and len(draft.buckets) <= 6
    assert all(len(c) <= 3 for c in draft.candidates)
    assert len(drafter.draft(sources, cap=3, max_leaves=1).candidates) <= 1  # the sequence's own cap


def test_rejections_teach_it_to_stop_drafting_that_evidence():
    """A bucket whose nodes the model keeps rejecting loses its rate, until the draft no longer pays."""
    curve = CostCurve(((1, 1.0), (2, 1.5), (4, 2.0), (8, 3.0)))
    drafter = TreeDrafter(curve, max_nodes=3, max_leaves=1, probe_every=10**6)
    sources = [(3, (3, 4, 5)), (3, (3, 4, 5))]  # a repeated span: unanimous, support 2
    first = drafter.draft(sources, cap=3)
    assert first.candidates == [(3, 4, 5)]
    for _ in range(20):
        draft = drafter.draft(sources, cap=3)
        if not draft.candidates:
            break
        drafter.record(draft, [9])  # the model wanted 9: the first token is rejected
    assert draft.candidates == []
    prior = PRIORS[3, True, True]
    assert drafter.rate((3, True, 2, True), prior) < 0.6 * prior  # what a fresh drafter believes


def test_acceptances_are_recorded_along_the_accepted_path_only():
    drafter = TreeDrafter(FLAT, max_nodes=12, max_leaves=4)
    draft = drafter.draft(EXAMPLE, cap=3)
    drafter.record(draft, [3, 6, 1])  # accepts 3, then 6 (not 4); 1 is the bonus token
    seen = [(bucket[:2], ok) for bucket, ok in drafter._seen]
    # c tested and accepted; its children d (rejected) and f (accepted) tested; nothing under f
    assert sorted(seen) == [((2, False), False), ((2, False), True), ((2, True), True)]


def test_undrafted_nodes_are_scored_as_the_text_reaches_them():
    drafter = TreeDrafter(STEEP, max_nodes=3, max_leaves=1, probe_every=10**6)
    draft = drafter.draft([(1, (3, 4, 5))], cap=3)
    assert draft.candidates == []  # weak evidence on a dear curve: a plain step
    drafter.record(draft, [3])  # the text went on with 3: the trie's first node was right
    drafter.record(drafter.draft([], cap=3), [4])  # then 4: its second too
    drafter.record(drafter.draft([], cap=3), [6])  # then 6, not 5
    drafter.record(drafter.draft([], cap=3), [5])  # nothing left of that trie to score
    first, second = (1, True, 1, True), (1, False, 1, True)  # level 1, support 1, unanimous
    assert list(drafter._seen) == [(first, True), (second, True), (second, False)]


def test_forgotten_tries_are_not_scored_against_another_text():
    drafter = TreeDrafter(STEEP, max_nodes=3, max_leaves=1, probe_every=10**6)
    drafter.record(drafter.draft([(1, (3, 4, 5))], cap=3), [3])
    drafter.forget_pending()  # say another sequence drafts next
    drafter.record(drafter.draft([], cap=3), [4])
    assert list(drafter._seen) == [((1, True, 1, True), True)]  # (3, 4) was not scored against its 4


@pytest.mark.parametrize("learn_undrafted", [True, False])
def test_evidence_never_drafted_still_earns_a_draft_once_the_text_bears_it_out(learn_undrafted):
    """Where width is dear, a weak-looking source is never drafted; scored on the text all the
    same, it earns a draft once the text keeps bearing it out. Scoring only drafted nodes, it never
    would (probes off)."""
    drafter = TreeDrafter(STEEP, max_nodes=3, max_leaves=1, probe_every=10**6, learn_undrafted=learn_undrafted)
    for _ in range(30):
        draft = drafter.draft([(1, (3, 4, 5))], cap=3)
        if draft.candidates:
            break
        for token in (3, 4, 5):
            drafter.record(draft, [token])
            draft = drafter.draft([], cap=3)
    assert draft.candidates == ([(3, 4, 5)] if learn_undrafted else [])


def test_probes_try_unobserved_evidence_and_back_off_while_they_lose():
    drafter = TreeDrafter(STEEP, max_nodes=3, max_leaves=1, probe_every=4, max_interval=32, probe_overhead=1.0)
    sources = [(1, (3, 4, 5))]
    shapes = []
    for _ in range(40):
        draft = drafter.draft(sources, cap=3)
        shapes.append(bool(draft.candidates))
        if draft.candidates:
            assert draft.probe  # on this curve only a probe drafts this weak evidence
            drafter.record(draft, [9])  # and loses
    probes = [i for i, wide in enumerate(shapes) if wide]
    # the first after probe_every steps, the next twice as far after a loss; then the optimistic
    # rate itself has learnt the losses (3 / 5 once seen twice), and no draft pays even for a probe
    assert probes == [3, 11]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_drafted_steps_match_greedy(arch, count_forwards):
    """Lookahead() on one sequence drafts with counts (adaptive, no window on a CPU): identical
    to model.generate, with multi-token steps, on every architecture."""
    model = tiny_model(arch)
    check_model(model)  # the one-time probe, outside the forward count
    steps = new = 0
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        lookahead = Lookahead(cost_curve=FLAT.points)
        counter = count_forwards(model)
        got = model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=lookahead)
        counter.close()
        assert got.tolist() == expected.tolist(), f"{arch} prompt {seed}"
        stats = lookahead.last_stats
        assert stats.config.count_drafting and counter.count == stats.steps
        assert sum(stats.settings.values()) == stats.steps - 1  # the drafter planned every step
        steps, new = steps + stats.steps, new + stats.new_tokens
    assert steps < new, f"no multi-token step happened for {arch}"


def test_the_window_rows_are_priced_into_every_drafted_tree():
    """A tree that pays on its own may not pay for the window's rows as well: the same evidence
    drafts without a window and steps plain with 60 rows riding along (T(63) = 3.2 T(1)), until
    the model has borne it out often enough to pay for them too."""
    sources = [(3, (3, 4, 5))]  # one earlier place, the context matching 3 tokens back
    drafter = TreeDrafter(FLAT, max_nodes=6, max_leaves=2, probe_every=10**6)
    assert drafter.draft(sources, cap=3).candidates == [(3, 4, 5)]
    assert drafter.draft(sources, cap=3, rider=60).candidates == []
    for _ in range(30):
        drafter.record(drafter.draft(sources, cap=3), [3, 4, 5, 6])  # accepted whole, every time
    assert drafter.draft(sources, cap=3, rider=60).candidates == [(3, 4, 5)]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_drafting_with_a_window_matches_greedy_and_runs_the_window_on_every_drafted_step(arch, monkeypatch):
    """Adaptive settings with a window (CUDA's default shape) count-draft too: the window's
    n-grams join the pool as one more source, its rows ride on every drafted step, and the steps
    that carry it alone are the ones the drafter counted as such. Identical to model.generate on
    every architecture, with multi-token steps."""
    from lookahead.runner import DecoderRunner

    layouts = []
    step = DecoderRunner.step

    def spy(self, layout, step_ids):
        layouts.append(layout)
        return step(self, layout, step_ids)

    monkeypatch.setattr(DecoderRunner, "step", spy)
    model = tiny_model(arch)
    steps = new = window_only = 0
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        lookahead = Lookahead(3, 4, 3, adaptive=True, cost_curve=FLAT.points)
        got = model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist(), f"{arch} prompt {seed}"
        stats = lookahead.last_stats
        assert sum(stats.settings.values()) == stats.steps - 1  # the drafter planned every step
        steps, new = steps + stats.steps, new + stats.new_tokens
        window_only += stats.settings.get("window", 0)
    assert steps < new, f"no multi-token step happened for {arch}"
    if not layouts:  # encoder-decoder models run Seq2SeqRunner, which has no drafter
        return
    drafted = [layout for layout in layouts if layout.candidate_slots]
    assert drafted and all(layout.level_slots for layout in drafted)  # the window rode on each
    assert window_only == sum(1 for layout in layouts if layout.level_slots and not layout.candidate_slots)


def test_the_window_runs_alone_within_its_budget_where_nothing_is_drafted():
    """Where no tree pays, one plain step in so many carries the window alone, so that its
    n-grams keep coming: here 60 rows cost T(61) = 3.09 T(1), and 10% of plain decoding's time
    buys one such step in 21."""
    drafter = TreeDrafter(FLAT, max_nodes=6, max_leaves=2)
    windows = [drafter.draft([], cap=3, rider=60).window for _ in range(44)]
    assert [i for i, w in enumerate(windows) if w] == [20, 41]
    assert drafter.summary() == {"plain": 42, "window": 2}
    assert not TreeDrafter(FLAT, max_nodes=6, max_leaves=2).draft([], cap=3).window  # no window: never
    strong = [(16, (3, 4, 5))] * 3
    assert TreeDrafter(FLAT, max_nodes=6, max_leaves=2).draft(strong, cap=3, rider=4).window  # rides on a tree


def test_count_drafting_drafts_when_on_and_is_never_consulted_when_off(monkeypatch):
    """On, the drafter plans every step after the prefill and its trees are accepted (multi-token
    steps); off, it is never asked, and the per-step setting plans instead. Output is plain
    generate's either way."""
    drafts = []
    draft = TreeDrafter.draft

    def spy(self, *args, **kwargs):
        drafts.append(draft(self, *args, **kwargs))
        return drafts[-1]

    monkeypatch.setattr(TreeDrafter, "draft", spy)
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 1)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    for flag in (True, False):
        drafts.clear()
        lookahead = Lookahead(count_drafting=flag, cost_curve=FLAT.points)
        got = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
        stats = lookahead.last_stats
        if flag:
            assert len(drafts) == stats.steps - 1 and any(d.candidates for d in drafts)
            assert stats.steps < stats.new_tokens  # the drafted trees were accepted
        else:
            assert drafts == [] and sum(stats.settings.values()) == stats.steps - 1  # the chooser planned


def test_a_later_drafter_starts_from_what_an_earlier_one_learnt():
    """carry_from: the observations and the probe spacing carry over, within the memory bound, so
    evidence that kept losing is not drafted again from the priors."""
    curve = CostCurve(((1, 1.0), (2, 1.5), (4, 2.0), (8, 3.0)))
    sources = [(3, (3, 4, 5)), (3, (3, 4, 5))]
    earlier = TreeDrafter(curve, max_nodes=3, max_leaves=1, probe_every=10**6, memory=8)
    while (draft := earlier.draft(sources, cap=3)).candidates:
        earlier.record(draft, [9])  # rejected until it stops drafting
    earlier._interval = 64
    fresh = TreeDrafter(curve, max_nodes=3, max_leaves=1, probe_every=10**6, memory=8)
    assert fresh.draft(sources, cap=3).candidates  # from the priors alone it drafts
    later = TreeDrafter(curve, max_nodes=3, max_leaves=1, probe_every=10**6, memory=8)
    later.carry_from(earlier)
    assert list(later._seen) == list(earlier._seen) and len(later._seen) <= 8
    assert later._fine == earlier._fine and later._interval == 64
    assert not later.draft(sources, cap=3).candidates


def test_one_lookahead_carries_its_drafting_statistics_to_the_next_call_on_the_same_model():
    model, other = tiny_model("llama"), tiny_model("qwen2")
    lookahead = Lookahead(cost_curve=FLAT.points)
    prompts = [repetitive_prompt(24, seed) for seed in range(3)]
    drafters = []
    for m, prompt in ((model, prompts[0]), (model, prompts[1]), (other, prompts[2])):
        expected = m.generate(prompt, max_new_tokens=30, do_sample=False)
        got = m.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
        (drafter,) = lookahead._drafters.values()
        drafters.append(list(drafter._seen))
    first, second, third = drafters
    assert 0 < len(first) < len(second) and second[: len(first)] == first  # carried, then its own
    assert third[: len(first)] != first  # another model starts afresh


def test_drafts_run_past_n_minus_1_up_to_the_draft_length_and_stay_exact():
    """N sizes the pool's n-grams; a count-drafted candidate may run to ``draft_length`` tokens
    (issue 14), so a step can emit more than N tokens; ``draft_length`` caps it. Outputs are
    identical to model.generate either way."""
    longest = {}
    for draft_length in (None, 3):
        longest[draft_length] = 0
        for arch in ("llama", "gpt2", "qwen2"):
            model = tiny_model(arch)
            for seed in range(3):
                prompt = repetitive_prompt(48, seed)
                expected = model.generate(prompt, max_new_tokens=60, do_sample=False)
                lookahead = Lookahead(cost_curve=FLAT.points, draft_length=draft_length)
                got = model.generate(prompt, max_new_tokens=60, do_sample=False, custom_generate=lookahead)
                assert got.tolist() == expected.tolist(), f"{arch} prompt {seed} draft_length {draft_length}"
                stats = lookahead.last_stats
                assert stats.config.ngram_size == 4 and len(stats.accepted_hist) == stats.config.max_emitted
                emitted = [k + 1 for k, count in enumerate(stats.accepted_hist) if count]
                longest[draft_length] = max(longest[draft_length], *emitted)
    assert longest[None] > 4  # past N: a drafted candidate of 4 or more tokens was accepted whole
    assert longest[3] <= 4


def test_draft_length_is_validated_and_caps_the_drafter():
    with pytest.raises(ValueError, match="draft_length must be an integer >= 1"):
        Lookahead(draft_length=0)
    config = Lookahead(draft_length=5).config_for("cpu")
    assert (config.ngram_size, config.draft_length, config.max_emitted) == (4, 5, 6)
    assert Lookahead(7, 4, 7).config_for("cpu").max_emitted == 4  # fixed settings: no drafter, N caps a step
