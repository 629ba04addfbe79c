"""Stopping, streaming and output options: lookahead stops exactly where plain decoding stops,
even inside an accepted n-gram, and streams every token in order."""

import pytest
import torch
from tiny_models import char_tokenizer, repetitive_prompt, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

from lookahead import Lookahead

SETTING = (4, 4, 4)


def plain_and_lookahead(model, prompt, **kwargs):
    expected = model.generate(prompt, do_sample=False, **kwargs)
    lookahead = Lookahead(*SETTING)
    got = lookahead.generate(model, prompt, do_sample=False, **kwargs)
    return expected, got, lookahead.last_stats


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_eos_inside_an_accepted_ngram_truncates_exactly(arch):
    model = tiny_model(arch)
    truncated_somewhere = False
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        free = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 24:].tolist()
        # Each distinct generated token is tried as the EOS token; min_new_tokens holds EOS back
        # until the model is deep in its repetitive phase, where whole n-grams get accepted.
        for eos in dict.fromkeys(free[1:]):
            for min_new in (0, 12):
                expected, got, stats = plain_and_lookahead(
                    model, prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=0, min_new_tokens=min_new
                )
                assert got.tolist() == expected.tolist(), f"prompt {seed} eos={eos}"
                assert got.shape[1] == 24 + 40 or got[0, -1].item() == eos
                truncated_somewhere |= stats.truncated_tokens > 0
        if truncated_somewhere:
            break
    assert truncated_somewhere, "no case stopped inside a multi-token step"


def test_several_eos_tokens():
    model = tiny_model("qwen3")
    prompt = repetitive_prompt(24, 1)
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 24:].tolist()
    eos = [free[12], free[20]]
    expected, got, _ = plain_and_lookahead(model, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert got.shape[1] < 24 + 30


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_user_stopping_criteria():
    model = tiny_model("mistral")
    prompt = repetitive_prompt(24, 2)
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 24:].tolist()
    criteria = StoppingCriteriaList([StopAfterToken(free[15])])
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    got = model.generate(
        prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria, custom_generate=Lookahead(*SETTING)
    )
    assert got.tolist() == expected.tolist()


def test_stop_strings():
    model, tok = tiny_model("llama"), char_tokenizer()
    prompt = repetitive_prompt(24, 0)
    text = tok.decode(model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 24:])
    for stop in (text[10:12], text[25:28]):
        expected, got, _ = plain_and_lookahead(model, prompt, max_new_tokens=40, stop_strings=[stop], tokenizer=tok)
        assert got.tolist() == expected.tolist()
        assert tok.decode(got[0, 24:]).endswith(stop)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        Lookahead(*SETTING).generate(tiny_model("llama"), repetitive_prompt(), max_new_tokens=5, stop_strings=["ab"])


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_every_token_in_order():
    model = tiny_model("gpt_neox")
    prompt = repetitive_prompt(24, 0)
    plain, ours = Recorder(), Recorder()
    model.generate(prompt, max_new_tokens=30, do_sample=False, streamer=plain)
    lookahead = Lookahead(*SETTING)
    lookahead.generate(model, prompt, max_new_tokens=30, do_sample=False, streamer=ours)
    assert lookahead.last_stats.steps < 30  # several tokens per step, still streamed one by one
    assert ours.puts == plain.puts and ours.ended and plain.ended


@pytest.mark.parametrize(
    "processors",
    [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=3),
        dict(min_new_tokens=10, eos_token_id=5),
        dict(suppress_tokens=[7, 8, 9], begin_suppress_tokens=[10]),
        dict(bad_words_ids=[[11], [12, 13]], sequence_bias={(14,): 3.0}),
    ],
    ids=lambda d: "+".join(d),
)
@pytest.mark.parametrize("arch", ["llama", "opt", "gemma3_text"])
@pytest.mark.parametrize("setting", [(4, 4, 4), (0, 3, 2), (2, 5, 3)], ids=lambda s: "W{}N{}G{}".format(*s))
def test_greedy_with_logits_processors_is_exact(arch, processors, setting):
    model = tiny_model(arch)
    accepted = 0
    for seed in range(2):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0, **processors)
        lookahead = Lookahead(*setting)
        got = lookahead.generate(model, prompt, max_new_tokens=30, do_sample=False, pad_token_id=0, **processors)
        assert got.tolist() == expected.tolist(), f"prompt {seed}"
        accepted += sum(lookahead.last_stats.accepted_hist[1:])
    assert accepted > 0  # candidates were accepted: the processed-prefix path ran


def test_scores_and_logits_of_emitted_positions():
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 0)
    kwargs = dict(
        max_new_tokens=25,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.2,
    )
    expected = model.generate(prompt, **kwargs)
    lookahead = Lookahead(*SETTING)
    got = model.generate(prompt, custom_generate=lookahead, **kwargs)
    assert lookahead.last_stats.steps < 25
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.scores) == len(got.logits) == 25
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    # the returned cache holds every token but the last, as transformers' own loop leaves it
    assert got.cache.get_seq_length() == got.sequences.shape[1] - 1
