"""Batches: every row token-identical to transformers' own batched greedy output, padding included.

Left-padded prompts of mixed lengths on the nine tiny architectures, batch sizes 2, 3, 4 and 8;
rows that stop early (EOS, stop strings, user criteria), processors, and finished rows leaving
the forward pass.
"""

import pytest
import torch
from tiny_models import CONFIGS, char_tokenizer, repetitive_prompt, tiny_model
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from lookahead import Lookahead
from lookahead.support import check_model

LENGTHS = {2: (12, 20), 3: (7, 24, 16), 4: (24, 5, 13, 9), 8: (3, 30, 12, 18, 6, 22, 9, 15)}
SETTINGS = {2: (4, 4, 4), 3: (2, 3, 2), 4: (0, 4, 4), 8: (5, 3, 5)}


def left_padded(lengths, seed=0, pad=0):
    """A batch of repetitive prompts of the given lengths, left-padded: (input_ids, attention_mask)."""
    rows = [repetitive_prompt(n, seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


class BatchSizes:
    """Records the batch size of every forward pass of a model."""

    def __init__(self, model):
        self.sizes = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.sizes.append(kwargs["input_ids"].shape[0])

    def close(self):
        self._handle.remove()


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("batch", list(LENGTHS))
def test_batch_matches_batched_greedy(arch, batch, count_forwards):
    model = tiny_model(arch)
    check_model(model)
    ids, mask = left_padded(LENGTHS[batch], seed=batch)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    lookahead = Lookahead(*SETTINGS[batch])
    counter = count_forwards(model)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
    assert got.tolist() == expected.tolist(), f"{arch} batch {batch}"
    stats = lookahead.last_stats
    assert counter.count == stats.steps and stats.batch_size == batch
    assert stats.sequence_steps < stats.new_tokens, "no multi-token step happened"
    assert sum(stats.accepted_hist[1:]) > 0


def eos_from_output(model, ids, mask, row=0):
    """A token that row ``row`` of plain greedy output emits midway: used as EOS so that rows
    stop at different steps."""
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[row, ids.shape[1] :]
    return int(plain[len(plain) // 3])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_rows_stopping_at_eos_are_padded_as_transformers_pads_them(arch):
    model = tiny_model(arch)
    ids, mask = left_padded(LENGTHS[4], seed=3)
    eos = eos_from_output(model, ids, mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    lookahead = Lookahead(4, 4, 4)
    sizes = BatchSizes(model)
    try:
        got = model.generate(ids, custom_generate=lookahead, **kwargs)
    finally:
        sizes.close()
    assert got.tolist() == expected.tolist()
    assert (expected[:, ids.shape[1] :] == eos).any(dim=1).sum() >= 1  # some row did stop early
    assert sizes.sizes[0] == 4 and sizes.sizes[-1] < 4  # finished rows stopped costing compute
    assert sizes.sizes == sorted(sizes.sizes, reverse=True)


class StopAfterToken(StoppingCriteria):
    """Stops a row once it has emitted one of ``tokens`` after the prompt (no eos_token_id
    attribute, so transformers decodes stopped rows on, unpadded, until every row has stopped)."""

    def __init__(self, tokens, prompt_len):
        self.tokens, self.prompt_len = torch.tensor(tokens), prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, self.prompt_len :], self.tokens).any(dim=1)


def test_rows_stopped_by_user_criteria_run_on_as_in_transformers():
    model = tiny_model("qwen2")
    ids, mask = left_padded(LENGTHS[3], seed=5)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[:, ids.shape[1] :]
    stops = [int(plain[b, 4 + 6 * b]) for b in range(3)]  # every row stops, at different steps
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    criteria = [StopAfterToken(stops, ids.shape[1])]
    expected = model.generate(ids, stopping_criteria=criteria, **kwargs)
    got = model.generate(ids, stopping_criteria=criteria, custom_generate=Lookahead(4, 4, 4), **kwargs)
    assert expected.shape[1] < ids.shape[1] + 30  # the criterion ended generation early
    assert got.tolist() == expected.tolist()


class StopByIndex(StoppingCriteria):
    """Stops sequence b of the batch once it is ``length + 4 * b`` long: it reads the batch index,
    so it only works if each sequence is shown at its own index."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.length + 4 * torch.arange(input_ids.shape[0])


def test_stopping_criteria_see_each_sequence_at_its_batch_index():
    model = tiny_model("llama")
    ids, mask = left_padded(LENGTHS[3], seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=95, pad_token_id=0)
    criteria = [StopByIndex(ids.shape[1] + 5)]
    expected = model.generate(ids, stopping_criteria=criteria, **kwargs)
    got = model.generate(ids, stopping_criteria=criteria, custom_generate=Lookahead(4, 4, 4), **kwargs)
    assert expected.shape[1] == ids.shape[1] + 5 + 8  # the last sequence stopped last, by its index
    assert (expected[0, ids.shape[1] + 5 :] == 0).all()  # the first was padded after its own stop
    assert got.tolist() == expected.tolist()


def test_stop_strings_in_a_batch():
    model, tok = tiny_model("llama"), char_tokenizer()
    ids, mask = left_padded(LENGTHS[3], seed=6)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    stop = tok.decode(plain[0, ids.shape[1] + 8 : ids.shape[1] + 10])  # two characters row 0 emits
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    expected = model.generate(ids, **kwargs)
    got = Lookahead(4, 4, 4).generate(model, ids, **kwargs)
    assert got.tolist() == expected.tolist()


def test_processors_in_a_batch():
    model = tiny_model("phi3")
    ids, mask = left_padded(LENGTHS[4], seed=7)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.2, no_repeat_ngram_size=4
    )
    expected = model.generate(ids, **kwargs)
    got = model.generate(ids, custom_generate=Lookahead(4, 4, 4), **kwargs)
    assert got.tolist() == expected.tolist()


def test_padded_batch_without_attention_mask_behaves_as_transformers():
    """transformers infers the mask from pad_token_id; the rows must come out the same as there."""
    model = tiny_model("llama")
    ids, _ = left_padded(LENGTHS[3], seed=8)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    got = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    assert got.tolist() == expected.tolist()


def test_right_padded_batch_is_refused():
    model = tiny_model("llama")
    ids, mask = left_padded(LENGTHS[2])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=5, custom_generate=Lookahead(4, 4, 4))


class RowsStreamer(BaseStreamer):
    """A streamer that takes whatever it is given, a batch too (transformers' own refuse a batch as
    the prompt arrives, before lookahead decoding starts): records each put."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        pass


def test_output_scores_need_one_row():
    model = tiny_model("llama")
    ids, mask = left_padded(LENGTHS[2])
    with pytest.raises(ValueError, match="batch of 1"):
        Lookahead(4, 4, 4).generate(
            model, ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, output_scores=True
        )


def test_a_streamer_is_refused_for_a_batch_by_lookahead_itself():
    """A streamer that accepts the batch's prompt gets past transformers: lookahead's own check
    refuses it, before any token is streamed."""
    model = tiny_model("llama")
    ids, mask = left_padded(LENGTHS[2])
    streamer = RowsStreamer()
    with pytest.raises(ValueError, match="streamers take one sequence: stream a batch of 1"):
        Lookahead(4, 4, 4).generate(model, ids, attention_mask=mask, max_new_tokens=5, streamer=streamer)
    assert streamer.puts == [ids.tolist()]  # generate streamed the prompt; lookahead streamed nothing


def test_num_return_sequences_samples_a_batch():
    model = tiny_model("llama")
    prompt = repetitive_prompt(16, 1)
    torch.manual_seed(0)
    out = model.generate(
        prompt, do_sample=True, num_return_sequences=3, max_new_tokens=12, custom_generate=Lookahead(4, 4, 4)
    )
    assert out.shape == (3, 28) and (out[:, :16] == prompt).all()


def test_each_row_of_a_batch_is_what_plain_generate_gives_its_prompt_alone():
    """Each row of a Lookahead() batch is what plain generate gives the same prompt alone,
    unpadded (the model's fp32 output does not depend on its batch neighbours beyond rounding,
    and these models have clear margins); so is Lookahead() on that prompt alone."""
    model = tiny_model("gpt_neox")
    ids, mask = left_padded(LENGTHS[3], seed=9)
    kwargs = dict(max_new_tokens=25, do_sample=False)
    batched = model.generate(ids, attention_mask=mask, custom_generate=Lookahead(), **kwargs)
    for b, length in enumerate(LENGTHS[3]):
        prompt = ids[b : b + 1, -length:]
        expected = model.generate(prompt, **kwargs)[0, length:].tolist()
        assert batched[b, ids.shape[1] :].tolist() == expected, f"row {b}"
        assert model.generate(prompt, custom_generate=Lookahead(), **kwargs)[0, length:].tolist() == expected
