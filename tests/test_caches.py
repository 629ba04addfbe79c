"""The cache the caller chose: plain generate's contract is the reference.

A ``cache_implementation`` lookahead cannot honour is refused by name (its steps keep their own
DynamicCache); an empty DynamicCache passed in is filled, as plain generate fills it, and comes
back as the same object; a cache that already holds tokens (an earlier turn of a chat) is
refused, since lookahead cannot continue from it exactly. Tiny random-weight models, fp32."""

import copy
import logging

import pytest
import torch
from tiny_models import repetitive_prompt, tiny_model
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StaticCache, StoppingCriteriaList

from lookahead import Lookahead

PROMPT = repetitive_prompt(24, seed=1)


@pytest.mark.parametrize(
    "implementation, options, reason",
    [
        # (cache_implementation, its options, the reason the refusal gives)
        ("quantized", {"cache_config": {"backend": "fp8"}}, "quantized cache gives other text"),
        ("static", {}, "static cache"),
        ("static", {"max_cache_len": 128}, "max_cache_len"),
        ("sliding_window", {}, "static cache"),  # ("hybrid": generate itself unsets it)
    ],
)
def test_a_cache_implementation_lookahead_cannot_use_is_refused_by_name(implementation, options, reason):
    model = tiny_model("llama")
    kwargs = dict(max_new_tokens=20, eos_token_id=None, cache_implementation=implementation, **options)
    with pytest.raises(ValueError, match=f"cannot use cache_implementation='{implementation}'.*{reason}"):
        model.generate(PROMPT, custom_generate=Lookahead(), **kwargs)


def test_a_quantized_cache_is_refused_because_it_changes_the_text():
    """Why "quantized" is refused rather than run on a full-precision cache: plain generate's text
    differs with it."""
    model = tiny_model("llama")
    plain = model.generate(PROMPT, max_new_tokens=40, eos_token_id=None)
    quantized = model.generate(PROMPT, max_new_tokens=40, eos_token_id=None, cache_implementation="quantized",
                               cache_config={"backend": "fp8"})  # fmt: skip
    assert not torch.equal(plain, quantized)


def test_an_offloaded_cache_is_refused_by_name():
    """generate cannot make an offloaded cache without CUDA, so the callable is handed the config
    directly, as generate hands it."""
    model = tiny_model("llama")
    config = GenerationConfig(max_length=40, cache_implementation="offloaded", pad_token_id=0)
    with pytest.raises(ValueError, match="cache_implementation='offloaded'.*memory an offloaded cache saves"):
        Lookahead()(model, PROMPT, LogitsProcessorList(), StoppingCriteriaList(), config)


def test_the_model_s_own_static_default_runs_with_a_warning_and_matches_generate(caplog):
    """A checkpoint's generation_config may ask for a static cache (for torch.compile): the caller
    did not choose it, and lookahead's own cache gives the same text."""
    model = copy.deepcopy(tiny_model("llama"))  # the shared model must not change
    model.generation_config.cache_implementation = "static"
    expected = model.generate(PROMPT, max_new_tokens=30, eos_token_id=None)
    with caplog.at_level(logging.WARNING, logger="lookahead"):
        got = model.generate(PROMPT, max_new_tokens=30, eos_token_id=None, custom_generate=Lookahead())
    assert torch.equal(got, expected)
    assert "cache_implementation='static'" in caplog.text


def _plain_and_lookahead(model, make_cache, **kwargs):
    mine, theirs = make_cache(), make_cache()
    plain = model.generate(PROMPT, cache=theirs, eos_token_id=None, return_dict_in_generate=True, **kwargs)
    out = model.generate(PROMPT, cache=mine, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=Lookahead(), **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, plain.sequences)
    return plain, theirs, out, mine


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_an_empty_dynamic_cache_passed_in_is_filled_and_returned_as_plain_generate_does(arch):
    """The caller's own object comes back, holding what plain generate's holds: every token but the
    last, per layer (with config=..., sliding-window layers keep their window, as they do there)."""
    model = tiny_model(arch)
    for make_cache in (DynamicCache, lambda: DynamicCache(config=model.config)):
        plain, theirs, out, mine = _plain_and_lookahead(model, make_cache, max_new_tokens=40)
        assert out.past_key_values is mine
        assert mine.get_seq_length() == theirs.get_seq_length() == out.sequences.shape[1] - 1
        assert len(mine.layers) == len(theirs.layers)
        for got, expected in zip(mine.layers, theirs.layers, strict=True):
            assert type(got) is type(expected)
            torch.testing.assert_close(got.keys, expected.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.values, expected.values, rtol=1e-4, atol=1e-4)


def test_a_filled_cache_continues_a_chat_with_plain_generate():
    """The next turn reuses the cache lookahead filled, as it would reuse plain generate's; and it is
    filled without return_dict_in_generate too."""
    model = tiny_model("llama")
    mine, theirs = DynamicCache(), DynamicCache()
    first = model.generate(PROMPT, cache=mine, max_new_tokens=20, eos_token_id=None, custom_generate=Lookahead())
    assert mine.get_seq_length() == first.shape[1] - 1
    plain_first = model.generate(PROMPT, cache=theirs, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(first, plain_first)
    follow_up = torch.cat([first, repetitive_prompt(12, seed=7)[:, 1:]], dim=1)
    got = model.generate(follow_up, cache=mine, max_new_tokens=20, eos_token_id=None)
    expected = model.generate(follow_up, cache=theirs, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(got, expected)


def test_a_cache_holding_an_earlier_turn_is_refused_by_name():
    model = tiny_model("llama")
    cache = DynamicCache()
    model.generate(PROMPT, cache=cache, max_new_tokens=5, eos_token_id=None)
    follow_up = torch.cat([PROMPT, repetitive_prompt(12, seed=7)], dim=1)
    with pytest.raises(ValueError, match=f"this one holds {cache.get_seq_length()} tokens.*plain generate"):
        model.generate(follow_up, cache=cache, max_new_tokens=5, custom_generate=Lookahead())


def test_caches_lookahead_cannot_fill_are_refused_by_name():
    model = tiny_model("llama")
    static = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="not a StaticCache"):
        model.generate(PROMPT, cache=static, max_new_tokens=5, custom_generate=Lookahead())
    batch = torch.cat([PROMPT, repetitive_prompt(24, seed=2)])
    with pytest.raises(ValueError, match="one sequence of a decoder-only model only"):
        model.generate(batch, cache=DynamicCache(), max_new_tokens=5, custom_generate=Lookahead())
