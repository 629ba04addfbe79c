"""Beam search with lookahead (lookahead.beams): the same beams as generate(num_beams=k), with the
same sequences_scores and beam_indices, across decoder-only and encoder-decoder families, the
beam options, batches, and the refusals. Tiny random-weight models, fp32."""

from __future__ import annotations

import pytest
import torch
from tiny_models import repetitive_prompt, tiny_model, tiny_seq2seq
from transformers import GenerationConfig

from lookahead import Lookahead
from lookahead.beam_state import BeamState
from lookahead.beams import keeps_scores_at_most_zero, prefill

DRAFTING = dict(window_size=0, ngram_size=4, max_candidates=3, adaptive=False)  # always drafts


def _compare(model, ids, scores: bool = True, lookahead=None, **kwargs):
    """Plain beam search and lookahead's, same call -> lookahead's output (and its stats), after
    asserting the same sequences and beam indices, and scores to 1e-5."""
    kwargs = {"return_dict_in_generate": True, "output_scores": scores, **kwargs}
    ref = model.generate(ids, **kwargs)
    lookahead = lookahead or Lookahead(**DRAFTING)
    out = model.generate(ids, custom_generate=lookahead, **kwargs)
    assert torch.equal(out.sequences, ref.sequences), (ref.sequences, out.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    if scores:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=0)
        assert len(out.scores) == len(ref.scores)
        for mine, theirs in zip(out.scores, ref.scores, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-5)  # tail log-probs near -10
    else:
        assert out.sequences_scores is None and ref.sequences_scores is None
    return out, lookahead.last_beam_stats


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("k", [2, 4, 5])
def test_same_beams_as_generate(arch, k):
    """One prompt, k beams, scores asked (every depth needs every beam's logits)."""
    model = tiny_model(arch)
    _, stats = _compare(model, repetitive_prompt(), num_beams=k, max_new_tokens=24)
    assert stats.drafted_steps > 0 and stats.depths == 24


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_same_beams_without_scores(arch):
    """Without output_scores a depth may leave out beams that were not drafted when none of their
    continuations can be among the best 2k (BeamState._prune): the beams are still the same."""
    model = tiny_model(arch)
    _compare(model, repetitive_prompt(seed=1), scores=False, num_beams=4, max_new_tokens=30)


def test_multi_depth_steps_on_a_repetitive_prompt():
    """The drafting really happened: fewer forward passes than new tokens."""
    model = tiny_model("llama")
    _, stats = _compare(model, repetitive_prompt(), scores=False, num_beams=2, max_new_tokens=40)
    assert stats.steps + 1 < stats.depths == 40, stats  # + 1: the prefill
    assert max(stats.depth_hist) >= 2


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_padded_batch_of_three(arch):
    model = tiny_model(arch)
    prompts = [repetitive_prompt(24, seed=s)[0] for s in range(3)]
    prompts[1], prompts[2] = prompts[1][:17], prompts[2][:9]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    _compare(model, ids, attention_mask=mask, num_beams=4, max_new_tokens=20, pad_token_id=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_each_prompt_is_prefilled_once_for_its_beams(arch):
    """generate prefills each prompt k times (once per beam); lookahead's beams prefill it once and
    copy its cache into the k rows, and then find the same beams (the padded batch above)."""
    model = tiny_model(arch)
    prompts = [repetitive_prompt(24, seed=s)[0] for s in range(3)]
    prompts[1] = prompts[1][:11]
    ids = torch.stack([torch.cat([torch.zeros(24 - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(24)[None] >= torch.tensor([24 - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(attention_mask=mask, num_beams=4, max_new_tokens=12, pad_token_id=0)
    _compare(model, ids, **kwargs)
    rows = []
    hook = model.register_forward_pre_hook(lambda _, a, kw: rows.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        model.generate(ids, custom_generate=Lookahead(**DRAFTING), **kwargs)
    finally:
        hook.remove()
    assert rows[0] == (3, 24) and {shape[0] for shape in rows[1:]} == {12}, rows


class _RecordingRunner:
    grows_by_reorder = True

    def __init__(self):
        self.prefilled, self.reordered = [], []

    def prefill(self, prompts, media=None):
        self.prefilled.append([list(p) for p in prompts])
        return torch.arange(float(len(prompts)))[:, None].repeat(1, 3)  # row i's logits: all i

    def reorder(self, rows):
        self.reordered.append(list(rows))


def test_prompts_that_differ_within_a_beam_group_are_prefilled_row_by_row():
    """beams.prefill shares a prompt's prefill only where its k rows hold the same tokens."""
    runner = _RecordingRunner()
    logits = prefill(runner, [[1, 2], [1, 2], [3], [3]], 2)
    assert runner.prefilled == [[[1, 2], [3]]] and runner.reordered == [[0, 0, 1, 1]]
    assert logits[:, 0].tolist() == [0, 0, 1, 1]
    runner = _RecordingRunner()
    logits = prefill(runner, [[1, 2], [1, 2], [3], [4]], 2)
    assert runner.prefilled == [[[1, 2], [1, 2], [3], [4]]] and runner.reordered == []
    assert logits[:, 0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.6, 1.5])
def test_early_stopping_and_length_penalty_with_eos_in_drafts(early_stopping, length_penalty):
    """EOS ids that the beams do produce (so drafts run through them), two of them, with each
    early_stopping value and length penalty, returning 3 of 4 beams."""
    model = tiny_model("llama")
    ids = repetitive_prompt()
    plain = model.generate(ids, num_beams=4, max_new_tokens=24)[0, ids.shape[1] :].tolist()
    eos = [plain[5], plain[11]]  # tokens of the plain answer: hypotheses finish mid-draft
    _compare(model, ids, num_beams=4, max_new_tokens=24, eos_token_id=eos, pad_token_id=0,
             early_stopping=early_stopping, length_penalty=length_penalty, num_return_sequences=3)  # fmt: skip


def test_no_repeat_ngram_and_max_length():
    model = tiny_model("qwen2")
    ids = repetitive_prompt()
    _compare(model, ids, num_beams=3, max_length=ids.shape[1] + 18, no_repeat_ngram_size=3)
    _compare(model, ids, scores=False, num_beams=3, max_length=ids.shape[1] + 18, no_repeat_ngram_size=3)


def test_beam_sampling_draws_the_same_beams():
    """do_sample with num_beams: each depth draws from the same tensor with the same generator
    state, one multinomial call per depth as plain beam sampling, so a seed gives the same beams."""
    model = tiny_model("llama")
    ids = repetitive_prompt()
    kwargs = {"num_beams": 3, "do_sample": True, "max_new_tokens": 20, "return_dict_in_generate": True}
    torch.manual_seed(7)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    out = model.generate(ids, custom_generate=Lookahead(**DRAFTING), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("arch", ["t5", "bart", "marian"])
@pytest.mark.parametrize("batch", [1, 3])
def test_encoder_decoder(arch, batch):
    model = tiny_seq2seq(arch)
    ids = torch.cat([repetitive_prompt(16, seed=s) for s in range(batch)])
    _compare(model, ids, num_beams=4, max_new_tokens=20)
    _compare(model, ids, scores=False, num_beams=2, max_new_tokens=20, num_return_sequences=2)


def test_encoder_decoder_drafts_from_the_source():
    """Lookahead().generate passes the encoder's input as text to draft from."""
    model = tiny_seq2seq("t5")
    ids = repetitive_prompt(16)
    lookahead = Lookahead(**DRAFTING)
    ref = model.generate(ids, num_beams=3, max_new_tokens=20)
    out = lookahead.generate(model, ids, num_beams=3, max_new_tokens=20)
    assert torch.equal(out, ref)
    assert lookahead.last_beam_stats.drafted_steps > 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_beam_groups": 2, "diversity_penalty": 1.0}, "num_beam_groups"),
        ({"force_words_ids": [[5]]}, "force_words_ids"),
    ],
)
def test_refused_by_name(kwargs, name):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=name):
        model.generate(repetitive_prompt(), custom_generate=Lookahead(**DRAFTING), num_beams=4, max_new_tokens=4,
                       trust_remote_code=True, **kwargs)  # fmt: skip


def test_prune_leaves_out_only_beams_that_cannot_matter():
    """BeamState._prune: a beam without logits is left out only when its running score is below
    the 2k-th best known continuation; at or above it, the depth is refused."""
    config = GenerationConfig(num_beams=2, max_length=10, length_penalty=1.0, early_stopping=False)
    state = BeamState(torch.zeros(2, 3, dtype=torch.long), config, eos_count=0, fill_value=0)
    state.running_scores = torch.tensor([[0.0, -5.0]])
    log_probs = torch.full((1, 2, 6), -9.0)
    log_probs[0, 0, :4] = torch.tensor([-0.1, -1.0, -2.0, -3.0])  # known beam 0; 4th best is -3
    assert state._prune(log_probs.clone(), [1])  # -5 < -3: nothing of beam 1 can be picked
    state.running_scores = torch.tensor([[0.0, -3.0]])
    assert not state._prune(log_probs.clone(), [1])  # -3 ties the 4th best: it might be picked


def test_only_known_processors_allow_pruning():
    from transformers import NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor

    assert keeps_scores_at_most_zero([NoRepeatNGramLogitsProcessor(3)])
    assert not keeps_scores_at_most_zero([SequenceBiasLogitsProcessor({(5,): 2.0})])


@pytest.fixture(scope="module")
def smollm2():
    from lookahead import models

    return models.load("smollm2", dtype="float32")


@pytest.mark.slow
def test_smollm2_humaneval_ten_prompts(smollm2):
    """The bundled SmolLM2, k = 4, on 10 HumanEval prompts: identical beams, in fewer passes."""
    from lookahead import datasets

    model, tokenizer = smollm2
    lookahead, passes, depths = Lookahead(**DRAFTING), 0, 0
    for prompt in datasets.humaneval(10):
        inputs = datasets.encode(tokenizer, prompt)
        ref = model.generate(**inputs, num_beams=4, max_new_tokens=32)
        out = model.generate(**inputs, num_beams=4, max_new_tokens=32, custom_generate=lookahead)
        assert torch.equal(out, ref), prompt.text[:80]
        passes += 1 + lookahead.last_beam_stats.steps
        depths += lookahead.last_beam_stats.depths
    assert passes < depths, (passes, depths)


def _seen_nothing(pricing) -> None:
    """As if many drafted steps had gained no depth, except right after a gain, where every depth
    went on: drafting does not pay now, and probes may."""
    pricing.went[False], pricing.tried[False] = [0.0] * 3, [1e6] * 3
    pricing.went[True], pricing.tried[True] = [1e6] * 3, [1e6] * 3


def _probe_gaps(pricing, depths) -> list[int]:
    """Plain steps before each drafted probe, when the probes gain ``depths`` in turn."""
    gaps = []
    for depth in depths:
        plain = 0
        while not (length := pricing.length(3, lambda n: 1 + 4 * n)):
            plain += 1
            assert plain < 10_000, "no probe"
        gaps.append(plain)
        pricing.record(length, depth)
    return gaps


def test_probes_come_every_few_steps_while_drafting_does_not_pay():
    """Drafting that costs more than it gains stops, but for a probe every PROBE_EVERY steps where
    probes are cheap (a drafted step at 1.3 plain ones)."""
    from lookahead.beams import PROBE_EVERY, DraftPricing

    pricing = DraftPricing(lambda tokens: 1.3, 3)
    _seen_nothing(pricing)
    assert _probe_gaps(pricing, [1, 1, 1, 1, 1]) == [PROBE_EVERY - 1] * 5


def test_a_step_that_gains_is_priced_by_what_follows_gains():
    """Drafted steps that gain make the next one likelier to gain: the pricing keeps what it saw
    after a gain apart, and drafts on after a gain where it would not after a plain step or a
    drafted step that gained nothing."""
    from lookahead.beams import DraftPricing

    pricing = DraftPricing(lambda tokens: 1.0 if tokens == 1 else 1.4, 1)
    pricing.went, pricing.tried = {False: [2.0], True: [8.0]}, {False: [10.0], True: [10.0]}
    assert pricing.length(1, lambda n: 5) == 0  # 1.2 depths for 1.4 steps
    pricing.record(1, 2)
    assert pricing.length(1, lambda n: 5) == 1  # after a gain: 1.8 for 1.4
    pricing.record(1, 1)
    assert pricing.length(1, lambda n: 5) == 0


@pytest.mark.parametrize("ratio", [2.0, 3.0, 3.5])
def test_dear_probes_wait_until_they_cost_at_most_their_share(ratio):
    """Where a drafted step costs ``ratio`` plain ones, probes that gain nothing cost at most
    PROBE_SHARE of the steps: a probe's extra cost (ratio - 1 plain steps) over the plain steps
    before it."""
    from lookahead.beams import PROBE_SHARE, DraftPricing

    pricing = DraftPricing(lambda tokens: ratio, 3)
    _seen_nothing(pricing)
    gaps = _probe_gaps(pricing, [1] * 6)
    extra = len(gaps) * (ratio - 1)
    assert extra / (sum(gaps) + len(gaps)) <= PROBE_SHARE + 1e-9, gaps


def test_no_probe_where_even_a_perfect_draft_would_not_pay():
    """Chains of up to 3 tokens advance at most 4 depths: where every drafted step costs 5 plain
    ones (bf16 on a CPU without AVX-512), no step drafts, not even a probe."""
    from lookahead.beams import DraftPricing

    pricing = DraftPricing(lambda tokens: 1.0 if tokens == 1 else 5.0, 3)
    pricing.went = {state: [2.0] * 3 for state in (False, True)}  # every depth went on, so far
    assert not any(pricing.length(3, lambda n: 1 + 4 * n) for _ in range(1000))


def test_no_probe_of_a_length_that_would_not_pay_even_after_a_gain():
    """Probes run only where a run of gains would pay: after a gain every depth goes on half the
    time here, so one token deep at 1.6 plain steps (1.5 depths) is never probed, while at 1.3 it
    is, every PROBE_EVERY plain steps."""
    from lookahead.beams import PROBE_EVERY, DraftPricing

    for cost, probes in ((1.6, 0), (1.3, 1000 // PROBE_EVERY)):
        pricing = DraftPricing(lambda tokens, cost=cost: 1.0 if tokens == 1 else cost, 1)
        pricing.went[False], pricing.tried[False] = [0.0], [1e6]  # plain steps seen, no gain yet
        assert sum(pricing.length(1, lambda n: 5) > 0 for _ in range(1000)) == probes


@pytest.mark.parametrize(("chance", "length"), [(0.8, 1), (0.95, 3)])
def test_pricing_drafts_the_length_that_gains_most_per_cost(chance, length):
    """Four chains a beam, each token per row 10% of a plain step: a first depth that goes on 80%
    of the time and deeper ones 10% make one token deep the best buy (1.8 depths for 1.4 steps,
    against 1.88 for 1.8 and 1.89 for 2.2); when every depth goes on 95% of the time, three."""
    from lookahead.beams import DraftPricing

    pricing = DraftPricing(lambda tokens: 1 + 0.1 * (tokens - 1), 3)
    deeper = 0.1 if chance < 0.9 else chance
    pricing.went[False], pricing.tried[False] = [chance, deeper, deeper], [1.0, 1.0, 1.0]
    assert pricing.length(3, lambda n: 1 + 4 * n) == length
    assert pricing.length(2, lambda n: 1 + 4 * n) == min(length, 2)  # no deeper than fits


def test_pricing_learns_how_often_each_depth_goes_on():
    """Steps drafted 2 deep that always advance 2 depths: the first depth goes on, the second never
    (so a 2-deep step is worth 2 depths, and 1 deep as much); a plain step's cost of 1 makes that
    worth drafting, while steps that advance 1 depth bring the estimate down to about 1."""
    from lookahead.beams import DraftPricing

    pricing = DraftPricing(lambda tokens: 1.0 + 0.05 * (tokens - 1), 3)
    for _ in range(40):
        pricing.record(2, 2)
    assert pricing.expected_depth(1) == pytest.approx(2.0, abs=0.01)
    assert pricing.expected_depth(3) == pytest.approx(2.0, abs=0.01)
    assert pricing.length(3, lambda n: 1 + 4 * n) == 1  # as many depths, for the fewest tokens
    for _ in range(40):
        pricing.record(1, 1)
    assert pricing.expected_depth(1) == pytest.approx(1.0, abs=0.02)
