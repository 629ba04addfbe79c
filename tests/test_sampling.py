"""Sampling keeps the model's distribution exactly, with every logits processor.

Two-sample chi-square tests compare thousands of lookahead draws with transformers' own sampling
on a tiny model whose distributions are sharp but not one-hot, position by position and on the
first pair. A power check in the same file shows that the test does reject a small change.
"""

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lookahead import Lookahead

ALPHA = 1e-3
SAMPLES = 1500
NEW = 5
# A sample of the model itself (temperature 0.5): its n-grams recur in new samples, so that
# pooled candidates do get accepted.
PROMPT = torch.tensor([[1, 5, 6, 7, 10, 14, 12, 6, 6, 4, 14, 7, 10, 12, 4, 14, 14, 12, 15, 5, 14, 5, 14, 5]])
MIXES = {
    "temperature+top_k": dict(temperature=0.7, top_k=6),
    "top_p+repetition_penalty": dict(top_p=0.9, repetition_penalty=1.3),
    "min_p+no_repeat_ngram+bias": dict(min_p=0.05, no_repeat_ngram_size=3, sequence_bias={(9,): 2.0}),
    "typical_p+epsilon_cutoff": dict(typical_p=0.8, epsilon_cutoff=0.05),
    "eta_cutoff": dict(eta_cutoff=0.1, temperature=0.9),
}


@functools.cache
def sharp_model():
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharp (top token ~0.5-0.8) but never one-hot distributions
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.mul_(24.0 if "lm_head" in name else 8.0)
    return model


def reference_draws(model, seed, **kwargs):
    torch.manual_seed(seed)
    out = model.generate(PROMPT.repeat(SAMPLES, 1), do_sample=True, max_new_tokens=NEW, min_new_tokens=NEW, **kwargs)
    return out[:, PROMPT.shape[1] :]


def lookahead_draws(model, seed, **kwargs):
    torch.manual_seed(seed)
    lookahead = Lookahead(3, 4, 4)
    rows, steps = [], 0
    for _ in range(SAMPLES):
        out = model.generate(
            PROMPT, do_sample=True, max_new_tokens=NEW, min_new_tokens=NEW, custom_generate=lookahead, **kwargs
        )
        rows.append(out[0, PROMPT.shape[1] :])
        steps += lookahead.last_stats.steps
    return torch.stack(rows), steps


def chi2_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of homogeneity on category ids; rare categories are pooled."""
    cats = torch.cat([a, b]).unique()
    table = torch.stack([(a[:, None] == cats).sum(0), (b[:, None] == cats).sum(0)]).double()  # [2, K]
    expected_min = table.sum(0) * min(len(a), len(b)) / (len(a) + len(b))
    rare = expected_min < 5
    if rare.any():
        table = torch.cat([table[:, ~rare], table[:, rare].sum(1, keepdim=True)], dim=1)
        table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2).item()


def pvalues(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One test per position's marginal, and one on the first pair."""
    result = {f"position {i}": chi2_pvalue(x[:, i], y[:, i]) for i in range(NEW)}
    result["first pair"] = chi2_pvalue(x[:, 0] * 16 + x[:, 1], y[:, 0] * 16 + y[:, 1])
    return result


@pytest.mark.parametrize("mix", list(MIXES))
def test_sampling_keeps_the_distribution(mix):
    model = sharp_model()
    kwargs = MIXES[mix]
    ours, steps = lookahead_draws(model, seed=1, **kwargs)
    theirs = reference_draws(model, seed=2, **kwargs)
    results = pvalues(ours, theirs)
    print(mix, {k: round(v, 4) for k, v in results.items()}, f"tokens/step {SAMPLES * NEW / steps:.3f}")
    assert min(results.values()) > ALPHA, results
    assert SAMPLES * NEW / steps > 1.05  # multi-token steps happened: acceptance was exercised


def test_sampling_in_a_batch_keeps_each_rows_distribution():
    """A batch mixing two prompts of different lengths (the shorter left-padded): each row's draws
    match transformers' draws for its own prompt."""
    model, short = sharp_model(), PROMPT[:, 10:]
    ids = torch.cat([PROMPT, torch.cat([torch.zeros(1, 10, dtype=torch.long), short], dim=1)]).repeat(5, 1)
    mask = (torch.arange(PROMPT.shape[1]) >= torch.tensor([0, 10]).repeat(5)[:, None]).long()  # [10, S]
    kwargs = dict(do_sample=True, max_new_tokens=NEW, min_new_tokens=NEW, **MIXES["temperature+top_k"])
    torch.manual_seed(11)
    lookahead, draws, sequence_steps = Lookahead(3, 4, 4), [], 0
    for _ in range(SAMPLES // 5):
        draws.append(model.generate(ids, attention_mask=mask, custom_generate=lookahead, **kwargs)[:, -NEW:])
        sequence_steps += lookahead.last_stats.sequence_steps
    draws = torch.cat(draws)  # [SAMPLES * 2, NEW], rows alternate long / short prompt
    torch.manual_seed(12)
    theirs_short = model.generate(short.repeat(SAMPLES, 1), **kwargs)[:, -NEW:]
    results = {
        "long prompt": pvalues(draws[0::2], reference_draws(model, seed=13, **MIXES["temperature+top_k"])),
        "short prompt": pvalues(draws[1::2], theirs_short),
    }
    print({k: {p: round(v, 4) for p, v in r.items()} for k, r in results.items()})
    assert min(min(r.values()) for r in results.values()) > ALPHA, results
    assert 2 * SAMPLES * NEW / sequence_steps > 1.05  # multi-token steps happened


def test_power_check_rejects_a_small_change():
    """The same test tells temperature 0.9 from 1.2: it can fail."""
    model = sharp_model()
    results = pvalues(reference_draws(model, 3, temperature=0.9), reference_draws(model, 4, temperature=1.2))
    print("power check", {k: f"{v:.2e}" for k, v in results.items()})
    assert min(results.values()) < ALPHA


def test_same_seed_same_output():
    model = sharp_model()
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(
            model.generate(
                PROMPT, do_sample=True, max_new_tokens=20, custom_generate=Lookahead(3, 4, 4), top_k=8, temperature=0.8
            ).tolist()
        )
    assert outs[0] == outs[1]


def test_token_tree_samples_as_the_same_candidates_on_their_own_rows(monkeypatch):
    """Shared rows give each candidate the same distributions as rows of its own: with the same
    seed, tree and chains draw the same tokens (a draw depends on the seed and the processed
    logits alone, so a shared row processed with another prefix would change it), with
    processors that read the candidate's prefix; and the tree did share rows."""
    from lookahead.runner import DecoderRunner

    shared = []
    step = DecoderRunner.step

    def counting(self, layout, step_ids):
        shared.append(sum(len(c) for c in layout.candidate_slots) - len(layout.node_slots))
        return step(self, layout, step_ids)

    monkeypatch.setattr(DecoderRunner, "step", counting)
    model = sharp_model()
    for seed in range(4):
        outs = []
        for tree in (True, False):
            torch.manual_seed(seed)
            lookahead = Lookahead(0, 4, 6, token_tree=tree)
            kwargs = dict(do_sample=True, max_new_tokens=30, temperature=0.8, repetition_penalty=1.2)
            outs.append(model.generate(PROMPT, custom_generate=lookahead, **kwargs).tolist())
        assert outs[0] == outs[1], seed
    assert sum(shared) > 0


def test_suppression_processors_are_honoured():
    """Tokens that bad_words_ids, suppress_tokens, begin_suppress_tokens and min_new_tokens forbid
    never appear, over many draws (each forbidden token is likely under the model)."""
    model = sharp_model()
    kwargs = dict(bad_words_ids=[[3]], suppress_tokens=[4], begin_suppress_tokens=[8], min_new_tokens=3)
    torch.manual_seed(0)  # (8 comes first in about 1 draw of 40: unseeded, 200 draws had none once)
    free = model.generate(PROMPT.repeat(200, 1), do_sample=True, max_new_tokens=30)[:, PROMPT.shape[1] :]
    assert (free == 3).any() and (free == 4).any() and (free[:, 0] == 8).any()  # the ban is not moot
    for _ in range(40):
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=30, custom_generate=Lookahead(3, 4, 4), **kwargs)
        new = out[0, PROMPT.shape[1] :].tolist()
        assert 3 not in new and 4 not in new and new[0] != 8 and 2 not in new[:3]


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_scores_and_logits_are_plain_generate_s_at_the_emitted_positions(do_sample):
    """Each returned score and logit is what plain generate returns for the same position, given
    the same prefix: the processed logits (every processor and warper applied) and the raw ones
    of the emitted token's own slot, whichever step and slot of the step emitted it."""
    model = sharp_model()
    kwargs = dict(top_k=4, temperature=0.7) if do_sample else dict(repetition_penalty=1.3)
    kwargs.update(do_sample=do_sample, return_dict_in_generate=True, output_scores=True, output_logits=True)
    torch.manual_seed(5)
    lookahead = Lookahead(3, 4, 4)
    out = model.generate(PROMPT, max_new_tokens=12, min_new_tokens=12, custom_generate=lookahead, **kwargs)
    assert len(out.scores) == len(out.logits) == out.sequences.shape[1] - PROMPT.shape[1] == 12
    assert lookahead.last_stats.steps < 12  # several tokens came from one step's slots
    if not do_sample:
        plain = model.generate(PROMPT, max_new_tokens=12, min_new_tokens=12, **kwargs)
        assert out.sequences.tolist() == plain.sequences.tolist()
    for i, (score, logit) in enumerate(zip(out.scores, out.logits, strict=True)):
        prefix = out.sequences[:, : PROMPT.shape[1] + i]
        one = model.generate(prefix, max_new_tokens=1, min_new_tokens=1, **kwargs)  # plain generate's position i
        torch.testing.assert_close(logit, one.logits[0], rtol=1e-4, atol=1e-4, msg=f"logits of token {i}")
        torch.testing.assert_close(score, one.scores[0], rtol=1e-4, atol=1e-4, msg=f"scores of token {i}")
        if do_sample:
            assert (score[0] > -float("inf")).sum() == 4  # top_k=4 was applied to this row


def test_iterator_streamer_in_a_thread_gets_every_sampled_token():
    import threading

    from tiny_models import char_tokenizer
    from transformers import TextIteratorStreamer

    model, tok = sharp_model(), char_tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    lookahead = Lookahead(3, 4, 4)
    result = {}

    def run():
        torch.manual_seed(7)
        result["out"] = lookahead.generate(
            model, PROMPT, do_sample=True, max_new_tokens=40, min_new_tokens=40, streamer=streamer
        )

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert lookahead.last_stats.steps < 40  # tokens arrived several per step, yet all were streamed
    assert text == tok.decode(result["out"][0, PROMPT.shape[1] :])
    assert result["out"].shape[1] == PROMPT.shape[1] + 40


# -- the joint distribution of three tokens, against the exact probabilities ---------------------

JOINT = 3  # tokens drawn per sample; 16^3 continuations, enumerated exactly
JOINT_KWARGS = dict(temperature=0.8, top_k=8)


@functools.cache
def exact_joint() -> torch.Tensor:
    """P(x0, x1, x2 | PROMPT) under min_new_tokens, temperature and top_k, enumerated: [16, 16, 16]."""
    from transformers import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    model = sharp_model()
    processors = LogitsProcessorList([
        MinNewTokensLengthLogitsProcessor(PROMPT.shape[1], JOINT, eos_token_id=2),
        TemperatureLogitsWarper(JOINT_KWARGS["temperature"]),
        TopKLogitsWarper(JOINT_KWARGS["top_k"]),
    ])  # fmt: skip
    joint = torch.ones(1, dtype=torch.double)
    prefixes = PROMPT
    for _ in range(JOINT):
        with torch.no_grad():
            logits = model(prefixes, use_cache=False).logits[:, -1].float()
        probs = torch.softmax(processors(prefixes, logits), dim=-1).double()  # [P, 16]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(16, 0), torch.arange(16).repeat(len(prefixes))[:, None]], 1)
    return joint.reshape(16, 16, 16)


def joint_pvalue(lookahead, samples: int, seed: int) -> tuple[float, float]:
    """Goodness of fit of lookahead's draws of three tokens to the exact joint -> (p-value, tokens/step)."""
    model = sharp_model()
    torch.manual_seed(seed)
    counts, steps = torch.zeros(16**3, dtype=torch.double), 0
    for _ in range(samples):
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=JOINT, min_new_tokens=JOINT,
                             custom_generate=lookahead, **JOINT_KWARGS)  # fmt: skip
        drawn = out[0, PROMPT.shape[1] :].tolist()
        if len(drawn) < JOINT:  # ended by EOS, which min_new_tokens forbids: the exact law gives it 0
            return 0.0, float("nan")
        a, b, c = drawn
        counts[a * 256 + b * 16 + c] += 1
        steps += lookahead.last_stats.steps
    expected = exact_joint().reshape(-1) * samples
    common = expected >= 5  # rare continuations pooled into one category
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    expected = torch.cat([expected[common], expected[~common].sum()[None]])
    stat = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    df = len(observed) - 1
    pvalue = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2).item()
    return pvalue, samples * JOINT / steps


FLAT = [(1, 1.0), (2, 1.0), (8, 1.0), (32, 1.0)]  # width is free: the adaptive tuner verifies


@pytest.mark.parametrize("make,seed", [(lambda: Lookahead(3, 4, 4), 21), (lambda: Lookahead(cost_curve=FLAT), 24)],
                         ids=["fixed(3,4,4)", "adaptive"])  # fmt: skip
def test_joint_distribution_of_three_tokens_is_exact(make, seed):
    pvalue, tokens_per_step = joint_pvalue(make(), samples=1500, seed=seed)
    print(f"joint p-value {pvalue:.4f}, tokens/step {tokens_per_step:.2f}")
    assert pvalue > ALPHA
    assert tokens_per_step > 1.05  # candidates were accepted: the rule was exercised


def test_the_joint_test_catches_plausible_bugs(monkeypatch):
    """The test above fails on two plausible slips: noise keyed by the seed alone (every position
    the same draw of noise), and draws from the raw instead of the processed logits."""
    import lookahead.engine
    import lookahead.step
    from lookahead.verify import position_noise

    with monkeypatch.context() as patch:
        patch.setattr(lookahead.engine, "position_noise", lambda seed, index, vocab: position_noise(seed, 0, vocab))
        assert joint_pvalue(Lookahead(3, 4, 4), samples=800, seed=22)[0] < ALPHA
    with monkeypatch.context() as patch:
        raw = lambda self, slot, noise: int((self.raw(slot).double() + noise).argmax())  # noqa: E731
        patch.setattr(lookahead.step.Scorer, "seeded_choice", raw)
        assert joint_pvalue(Lookahead(3, 4, 4), samples=800, seed=23)[0] < ALPHA


def test_a_seed_gives_one_text_whatever_the_settings_and_on_every_reuse():
    """Each sequence samples from noise keyed by (its seed, position), its seed drawn from torch's
    global generator: the text follows from torch.manual_seed alone. Not from W/N/G, and not from
    what a reused instance's drafter learnt on earlier calls, which changes its drafts (it did,
    before: three calls of one Lookahead() gave three texts)."""
    model = sharp_model()
    reused = Lookahead(cost_curve=FLAT)

    def sample(lookahead, seed=11, **kwargs):
        torch.manual_seed(seed)
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=40, min_new_tokens=40, temperature=0.8, top_k=8,
                             custom_generate=lookahead, **kwargs)  # fmt: skip
        return out[:, PROMPT.shape[1] :].tolist()

    first = sample(reused)
    assert reused.last_stats.tokens_per_step > 1.2  # drafts were accepted: step shapes varied
    assert [sample(reused), sample(reused), sample(Lookahead(3, 4, 4)), sample(Lookahead(0, 4, 4))] == [first] * 4
    assert sample(reused, seed=12) != first
    rows = sample(Lookahead(3, 4, 4), num_return_sequences=3)
    assert len({tuple(row) for row in rows}) == 3  # each sequence has a seed of its own
