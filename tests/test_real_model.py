"""The bundled SmolLM2-135M-Instruct in fp32: token-identical to model.generate, with real gains.

Marked slow (about two minutes); CI runs it. The first run converts the bundled GGUF once.
"""

import pytest
import torch

from lookahead import Lookahead, models

pytestmark = pytest.mark.slow

CODE = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards.\n\n'
    '    >>> is_palindrome("level")\n    True\n    >>> is_palindrome("hello")\n    False\n    """\n',
    "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
    '    """From a list of integers, return the list of maxima seen so far.\n'
    '    >>> running_max([1, 2, 3, 2, 3, 4, 2])\n    [1, 2, 3, 3, 3, 4, 4]\n    """\n',
]
CHAT = [
    "Write a short poem about the sea.",
    "Explain in three sentences what a hash table is.",
    "List five fruits and their colours.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    return models.load("smollm2", dtype="float32")


def encode(tokenizer, text, chat):
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(text, return_tensors="pt", add_special_tokens=not chat)


@pytest.mark.parametrize(
    "text,chat",
    [(t, False) for t in CODE] + [(t, True) for t in CHAT],
    ids=["code0", "code1", "chat0", "chat1", "chat2"],
)
def test_real_model_matches_greedy(smollm2, text, chat):
    model, tokenizer = smollm2
    inputs = encode(tokenizer, text, chat)
    expected = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    for setting in [(4, 4, 4), (0, 5, 5)]:
        lookahead = Lookahead(*setting)
        got = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist(), f"{setting} diverged"


@pytest.mark.parametrize("batch", [2, 3, 4, 8])
def test_real_model_batch_matches_batched_greedy(smollm2, batch):
    """Left-padded batches of code and chat prompts of mixed lengths; chat rows end at EOS and
    are padded while the code rows go on."""
    model, tokenizer = smollm2
    texts = [encode(tokenizer, t, chat) for t, chat in [(t, False) for t in CODE] + [(t, True) for t in CHAT]]
    rows = [texts[i % len(texts)]["input_ids"][0] for i in range(batch)]
    rows = [row[: len(row) - (i // len(texts)) * 7] for i, row in enumerate(rows)]  # repeats are cut shorter
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    kwargs = dict(attention_mask=mask, max_new_tokens=48, do_sample=False)
    expected = model.generate(ids, **kwargs)
    lookahead = Lookahead(4, 4, 4)
    got = model.generate(ids, custom_generate=lookahead, **kwargs)
    assert got.tolist() == expected.tolist()
    assert lookahead.last_stats.tokens_per_step > 1.0


def test_code_prompt_compresses(smollm2):
    """On code, several tokens per forward pass: above 1.3 (HumanEval/3, whose completion the
    model writes by reusing the prompt's own code)."""
    from lookahead import datasets

    model, tokenizer = smollm2
    prompt = datasets.humaneval(4)[3]
    inputs = datasets.encode(tokenizer, prompt)
    expected = model.generate(**inputs, max_new_tokens=96, do_sample=False)
    lookahead = Lookahead(4, 4, 4)
    got = model.generate(**inputs, max_new_tokens=96, do_sample=False, custom_generate=lookahead)
    assert got.tolist() == expected.tolist()
    assert lookahead.last_stats.tokens_per_step > 1.3


def test_stop_string_and_streaming_on_real_tokenizer(smollm2):
    from transformers import TextIteratorStreamer

    model, tokenizer = smollm2
    inputs = encode(tokenizer, CODE[0], chat=False)
    kwargs = dict(max_new_tokens=60, do_sample=False, stop_strings=["return"], tokenizer=tokenizer)
    expected = model.generate(**inputs, **kwargs)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    got = Lookahead(4, 4, 4).generate(model, **inputs, streamer=streamer, **kwargs)
    assert got.tolist() == expected.tolist()
    streamed = "".join(streamer)
    assert streamed == tokenizer.decode(got[0, inputs["input_ids"].shape[1] :])
    assert "return" in streamed[-12:]  # a stop string may end inside the last token


def test_cli_generate_compare(capsys):
    from lookahead.cli import main

    code = main(
        ["generate", "def fibonacci(n):", "--max-new-tokens", "24", "--compare", "-W", "3", "-N", "4", "-G", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tokens/s" in out and "tokens/step" in out and "mean accepted length" in out
    assert "outputs identical" in out


def test_cli_samples_and_compares_speed_only(capsys):
    from lookahead.cli import main

    args = ["generate", "def add(a, b):", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9"]
    assert main([*args, "--top-k", "20", "--repetition-penalty", "1.1", "--seed", "3", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "sampled: the texts are two draws" in out and "tokens/s ratio" in out
    assert main([*args, "--seed", "3"]) == 0
    first = capsys.readouterr().out.split("[lookahead")[0]
    assert main([*args, "--seed", "3"]) == 0
    assert capsys.readouterr().out.split("[lookahead")[0] == first  # the same seed, the same text
    assert main(["generate", "hi", "--top-k", "5"]) == 1  # top-k without temperature: refused
    assert "--temperature > 0" in capsys.readouterr().err


def test_cli_errors_are_one_line(capsys):
    from lookahead.cli import main

    assert main(["generate", "hi", "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'no-such-model'" in err[0]
    assert main(["generate", "hi", "-N", "1"]) == 1
    assert "ngram_size (N) must be an integer >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--dtype", "int3"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bf16_runs_and_reports(smollm2, count_forwards):
    """bf16 is where speed is measured; it must run and report what it did (exactness there is
    studied, not asserted): its statistics agree with the forward passes counted, and it drafted
    (fewer passes than tokens) on a prompt that repeats itself."""
    model, tokenizer = smollm2
    model16 = model.to(torch.bfloat16)
    try:
        inputs = encode(tokenizer, "red, green, blue, " * 3 + "red,", chat=False)  # goes on repeating
        lookahead = Lookahead(4, 4, 4)
        model16.generate(**inputs, max_new_tokens=2, do_sample=False, custom_generate=lookahead)  # probe first
        counter = count_forwards(model16)
        out = model16.generate(**inputs, max_new_tokens=16, do_sample=False, custom_generate=lookahead)
        stats = lookahead.last_stats
        assert out.shape[1] == inputs["input_ids"].shape[1] + 16 == inputs["input_ids"].shape[1] + stats.new_tokens
        assert counter.count == stats.steps == sum(stats.accepted_hist)
        # every token is accounted for by the step that emitted it, and the ratio is the tokens over
        # the forward passes counted outside lookahead; below 16 passes, steps emitted several tokens
        assert sum((k + 1) * n for k, n in enumerate(stats.accepted_hist)) == 16
        assert stats.tokens_per_step == 16 / counter.count and counter.count < 16
    finally:
        model.to(torch.float32)
