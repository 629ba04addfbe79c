"""transformers' own route for shipping a decoding method: the repository's ``custom_generate/``
folder, loaded from a local path with ``trust_remote_code=True``. That route hands over every
generate() argument, so streamers and stop strings work through it."""

from pathlib import Path

import pytest
from tiny_models import char_tokenizer, repetitive_prompt, tiny_model
from transformers import TextIteratorStreamer

ROOT = str(Path(__file__).resolve().parents[1])


def test_custom_generate_folder_matches_greedy_and_streams_and_stops():
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    prompt = repetitive_prompt(24, 1)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    got = model.generate(prompt, custom_generate=ROOT, trust_remote_code=True, max_new_tokens=30, do_sample=False)
    assert got.tolist() == expected.tolist()

    fixed = model.generate(prompt, custom_generate=ROOT, trust_remote_code=True, max_new_tokens=30,
                           do_sample=False, window_size=2, ngram_size=3, max_candidates=2)  # fmt: skip
    assert fixed.tolist() == expected.tolist()

    text = tokenizer.decode(expected[0, prompt.shape[1] :])
    stop = text[5:7]  # stops the output part-way
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    stopped = model.generate(prompt, custom_generate=ROOT, trust_remote_code=True, max_new_tokens=30,
                             do_sample=False, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer)  # fmt: skip
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert stopped.tolist() == plain.tolist() and stopped.shape[1] < expected.shape[1]
    assert "".join(streamer) == tokenizer.decode(stopped[0, prompt.shape[1] :])


def test_custom_generate_folder_needs_trust_remote_code():
    with pytest.raises(ValueError, match="trust_remote_code"):
        tiny_model("llama").generate(repetitive_prompt(), custom_generate=ROOT, max_new_tokens=3)
