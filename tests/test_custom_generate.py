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


def test_a_streamer_passed_with_a_custom_generate_callable_is_dropped_by_transformers():
    """Known limitation, not ours to fix (docs/upstream-streamer.md): with a callable
    ``custom_generate``, transformers feeds the streamer the prompt, then hands the callable no
    streamer, so no token arrives and end() never comes (a TextIteratorStreamer reader waits for
    ever); nothing the callable is handed shows it (its arguments, the generation config), so
    lookahead cannot refuse it. ``Lookahead().generate(model, ..., streamer=...)`` and the folder
    route stream. If this fails, transformers now hands the streamer on: check that the tokens
    arrive, then drop the warning from the README."""
    from transformers.generation.streamers import BaseStreamer

    from lookahead import Lookahead

    class Recorder(BaseStreamer):
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(("put", value.tolist()))

        def end(self):
            self.calls.append(("end", None))

    model, prompt = tiny_model("llama"), repetitive_prompt(24, 1)
    dropped, streamed = Recorder(), Recorder()
    out = model.generate(prompt, max_new_tokens=10, custom_generate=Lookahead(), streamer=dropped)
    assert dropped.calls == [("put", prompt.tolist())]  # the prompt only, and no end()
    Lookahead().generate(model, prompt, max_new_tokens=10, streamer=streamed)
    assert streamed.calls[0] == ("put", prompt.tolist()) and streamed.calls[-1] == ("end", None)
    assert [t for kind, value in streamed.calls[1:-1] for t in value] == out[0, prompt.shape[1] :].tolist()
