"""The clairvoyant bound (lookahead.bound): its candidates, its shortest path, and that no real
run of the loop beats it on the same candidates."""

import itertools

import pytest
from tiny_models import repetitive_prompt, tiny_model

from lookahead import Lookahead
from lookahead.bound import clairvoyant_bound, matched, prompt_lookup_candidates, suffix_candidates
from lookahead.costs import CostCurve

FREE = CostCurve(((1, 1.0), (128, 1.0)))  # width costs nothing: the bound counts forward passes
STEEP = CostCurve(((1, 1.0), (2, 3.0), (128, 200.0)))  # any wide step costs more than it can emit


def test_suffix_candidates_follow_every_earlier_occurrence_of_the_longest_suffix():
    text = [5, 6, 7, 9, 6, 7, 8, 1, 6, 7]
    assert suffix_candidates(text, max_suffix=4, length=3) == [(8, 1, 6), (9, 6, 7)]  # "6 7", newest first
    assert suffix_candidates(text, max_suffix=1, length=2) == [(8, 1), (9, 6)]  # "7" alone, the same places
    assert suffix_candidates([1, 2, 3], length=3) == []  # nothing repeats
    assert suffix_candidates((4, 4, 4), length=2) == [(4,)]  # tuples too; "4 4" ended at 1 only
    assert matched((3, 4, 9), [3, 4, 5]) == 2 and matched((), [1]) == 0


def test_prompt_lookup_candidates_are_transformers_own():
    """The candidate transformers' prompt lookup verifies at each position (the earliest occurrence
    of a suffix of at most 2 tokens), checked against its PromptLookupCandidateGenerator on random
    texts over small vocabularies, where suffixes recur at many places."""
    import random

    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = random.Random(0)
    compared = differs_from_suffix_source = 0
    for _ in range(60):
        vocab = rng.choice([3, 5, 8])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(2, 20))]
        ours = prompt_lookup_candidates(prompt, output, length=3)
        for i in range(len(output)):  # 0: the candidate transformers verifies in the prefill
            text = prompt + output[:i]
            generator = PromptLookupCandidateGenerator(num_output_tokens=3, max_length=len(text) + 50)
            ids, _ = generator.get_candidates(torch.tensor([text]))
            theirs = tuple(ids[0, len(text) :].tolist())
            assert ours.get(i, [()]) == [theirs], (prompt, output, i)
            compared += 1
            differs_from_suffix_source += bool(theirs) and theirs not in [c[:3] for c in suffix_candidates(text)]
    assert compared > 500 and differs_from_suffix_source > 0  # it adds candidates the suffix source lacks


def test_prompt_lookup_priced_never_beats_its_bound():
    """Prompt lookup run on a text (its candidate at every step, paid for in full, the first one
    verified in the prefill as transformers does) never costs less than the bench's bound for it:
    a bound over the suffix source alone did, by up to 1.9x, and one without the prefill's
    candidate by up to 1.14x."""
    import random

    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from lookahead.bench import _bounds, methods_for

    curve = CostCurve(((1, 1.0), (4, 1.05), (8, 1.2)))
    lookup = next(m for m in methods_for() if m.name.startswith("prompt_lookup"))
    rng, worst = random.Random(1), 0.0
    for _ in range(400):
        vocab = rng.choice([3, 4, 5])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(5, 25))]
        i, cost = 0, 0.0
        while i < len(output):
            text = prompt + output[:i]  # transformers' own candidate, independent of lookahead.bound
            generator = PromptLookupCandidateGenerator(num_output_tokens=3, max_length=len(text) + 50)
            candidate = tuple(generator.get_candidates(torch.tensor([text]))[0][0, len(text) :].tolist())
            candidate = candidate[: len(output) - 1 - i]
            cost += curve(1 + len(candidate)) if i else 0.0  # the first candidate rides on the prefill
            i += 1 + matched(candidate, output[i:])
        if cost == 0:  # the prefill emitted the whole text; the bound keeps one step (see _shortest_path)
            continue
        worst = max(worst, (len(output) - 1) / cost / _bounds(prompt, output, curve, lookup)["bound_own_cap"])
    assert worst <= 1.0 + 1e-9


def test_bound_on_a_copied_span():
    """The output copies the prompt after one new token: one plain step (nothing repeats yet),
    then one step verifying the rest, so 8 decoded tokens in 2 forward passes when width is
    free; when it is dear, plain steps only."""
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 4, 5, 6, 7, 8]
    free = clairvoyant_bound(prompt, output, FREE)
    assert (free.speedup, free.steps, free.tokens) == (4.0, 3, 9)  # 3 passes: the prefill and two steps
    capped = clairvoyant_bound(prompt, output, FREE, cap=3)  # 1 + 4 + 3: three steps
    assert capped.speedup == pytest.approx(8 / 3)
    assert clairvoyant_bound(prompt, output, STEEP).speedup == 1.0
    assert clairvoyant_bound(prompt, [], FREE).speedup == 1.0
    with pytest.raises(ValueError, match="cap"):
        clairvoyant_bound(prompt, output, FREE, cap=-1)


def test_loop_candidates_count_where_the_text_has_none():
    """No suffix of the text repeats, so only a candidate the loop had (its window's n-grams,
    say) lets the bound step wide: extra candidates are keyed by output position."""
    prompt, output = [1, 2, 3], [10, 11, 12, 13, 14]
    assert clairvoyant_bound(prompt, output, FREE).speedup == 1.0
    bound = clairvoyant_bound(prompt, output, FREE, extra={1: [(11, 12, 13)]})
    assert (bound.speedup, bound.steps) == (4.0, 2)  # 11 12 13 14 in one step...
    wrong_place = clairvoyant_bound(prompt, output, FREE, extra={2: [(11, 12, 13)]})
    assert wrong_place.speedup == 1.0  # ... but only where the loop had it


def test_the_shortest_path_beats_every_policy():
    """On small texts over two tokens, every way of cutting the decode into steps that the
    candidates allow costs at least the bound's (brute force over all step sequences; the prefill
    may verify a candidate at position 0 too, leaving the decode at least one step)."""
    curve = CostCurve(((1, 1.0), (2, 1.3), (4, 2.0), (8, 3.5)))
    for bits in itertools.product([0, 1], repeat=9):
        prompt, output = [0, 1, 1, 0], list(bits)
        text, bound = prompt + output, clairvoyant_bound(prompt, output, curve, cap=3)
        longest = [
            min(
                3,
                len(output) - 1 - i - (i == 0),
                max((matched(c, output[i:]) for c in suffix_candidates(text[: 4 + i], 4, 3)), default=0),
            )
            for i in range(len(output))
        ]
        cheapest = min(_cheapest(1 + a, longest, curve) for a in range(longest[0] + 1))
        assert bound.speedup == pytest.approx((len(output) - 1) / cheapest)


def _cheapest(i: int, longest: list[int], curve: CostCurve) -> float:
    """The cheapest way to decode from position i on, trying every step length allowed."""
    if i >= len(longest):
        return 0.0
    return min(curve(1 + a) + _cheapest(i + 1 + a, longest, curve) for a in range(longest[i] + 1))


@pytest.mark.parametrize(
    "settings",
    [
        dict(window_size=3, ngram_size=4, max_candidates=3),
        dict(),
        # drafting with a window: candidates up to the draft length, the window's n-grams among them
        dict(window_size=3, ngram_size=4, max_candidates=3, adaptive=True, cost_curve=((1, 1.0), (64, 1.2))),
    ],
)
def test_no_run_takes_fewer_steps_than_the_bound_on_its_own_candidates(settings):
    """With free width the bound is the fewest forward passes; the loop's own run is one of the
    paths it considers (its candidates at hand are recorded by output position), so no run can
    take fewer. Fails if the recorded positions are off by one."""
    model = tiny_model("llama")
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        lookahead = Lookahead(**settings, record_candidates=True)
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=lookahead)
        stats, trace = lookahead.last_stats, lookahead.last_candidates[0]
        assert trace and all(0 < position < 40 for position in trace)
        output = out[0, prompt.shape[1] :].tolist()
        bound = clairvoyant_bound(prompt[0].tolist(), output, FREE, cap=stats.config.max_emitted - 1, extra=trace)
        assert bound.steps <= stats.steps
        assert stats.steps < len(output)  # the loop did step wide: the comparison says something
