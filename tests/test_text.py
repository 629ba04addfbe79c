"""The streaming text decoder: what it hands out equals the tokenizer's decode of every token, for
real tokenizer pipelines (a Llama-style byte-fallback BPE built here, SmolLM2's byte-level BPE),
and each token costs a bounded amount of decoding however long the text."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from lookahead import models
from lookahead.text import Detokenizer, TextDecoder

MULTI_BYTE = "é€中😀ß"


@functools.cache
def byte_fallback_tokenizer():
    """Llama's tokenizer pipeline in small: SentencePiece-style BPE over a few words, with every
    other character spelled as its UTF-8 bytes (<0xE2><0x82><0xAC> for "€")."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *"abcdehlorstwé", "▁t", "▁th", "▁the", "he", "ll", "▁hello", "or", "▁w", "▁wor", "ld"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e"), ("l", "l"), ("▁", "w"), ("o", "r"), ("▁w", "or"),
              ("l", "d")]  # fmt: skip
    merges += [("▁", "h"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def streamed(tokenizer, ids: list[int], sizes: list[int], stop=()) -> str:
    """The text a stream hands out when steps bring ``sizes`` tokens each (cycled)."""
    decoder, pieces, i, k = TextDecoder(tokenizer, stop), [], 0, 0
    while i < len(ids):
        step = sizes[k % len(sizes)]
        pieces.append(decoder.push(ids[i : i + step]))
        i, k = i + step, k + 1
    return "".join(pieces) + decoder.flush()


@settings(max_examples=150, deadline=None)
@given(
    st.text(alphabet=st.sampled_from([*"helo wrdtbé\n", *MULTI_BYTE]), min_size=1, max_size=60),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_byte_fallback_stream_equals_decode_of_all_tokens(text, sizes):
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert streamed(tokenizer, ids, sizes) == tokenizer.decode(ids, skip_special_tokens=True)


def test_byte_fallback_text_that_spans_many_byte_tokens():
    """Forty characters spelled as bytes in a row (160 byte tokens): the window settles them as
    they come and the text is still exact."""
    tokenizer = byte_fallback_tokenizer()
    text = "the 😀😀😀😀😀😀😀😀😀😀 world 中中中中中中中中中中中中中中中中中中中中€€€€€€€€€€ hello"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert sum(1 for i in ids if 3 <= i < 259) > 100
    for sizes in ([1], [3], [2, 7], [len(ids)]):
        assert streamed(tokenizer, ids, sizes) == tokenizer.decode(ids, skip_special_tokens=True) == text


class CountingTokenizer:
    """Counts the token ids handed to ``decode``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_decoding_work_per_token_is_bounded_however_long_the_text():
    """3,000 tokens with stop strings: every push hands the tokenizer at most a bounded number of
    ids (decoding the whole text again each step made a stream O(T^2))."""
    tokenizer = CountingTokenizer(byte_fallback_tokenizer())
    text = " ".join(["the world", "hello 中€😀", "é tbd"] * 200)
    ids = tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 3000
    decoder, costs, pieces = TextDecoder(tokenizer, stop=["never there", "中€ hello"]), [], []
    for i in range(0, len(ids), 2):
        before = tokenizer.decoded
        pieces.append(decoder.push(ids[i : i + 2]))
        costs.append(tokenizer.decoded - before)
    bound = 2 * (Detokenizer.CONTEXT + Detokenizer.REACH + Detokenizer.MAX_PENDING + 2) * 6
    assert max(costs) <= bound, max(costs)
    assert sum(costs[-100:]) <= sum(costs[:100]) * 1.5  # the last steps cost what the first did
    assert "".join(pieces) + decoder.flush() == text


def test_a_stop_string_is_cut_alike_in_a_long_text():
    tokenizer = byte_fallback_tokenizer()
    text = "hello world " * 300 + "the 中€ end, and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for sizes in ([1], [4], [3, 5]):
        assert streamed(tokenizer, ids, sizes, stop=["中€ e"]) == "hello world " * 300 + "the "


@functools.cache
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(models.resolve("smollm2"))


@pytest.mark.slow
def test_smollm2_stream_equals_decode_of_all_tokens():
    """SmolLM2's byte-level BPE: text with multi-byte characters, and random ids (partial
    characters anywhere), streamed in steps of several sizes."""
    tokenizer = smollm2_tokenizer()
    text = "Größe: 東京タワー 😀👍🏽 naïve café — «ok»\n\tdef f(x):\n        return x ** 2  # ünïcödé " * 20
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    noise = [rng.randrange(len(tokenizer)) for _ in range(3000)]
    for tokens in (ids, noise):
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        for sizes in ([1], [2], [1, 5, 3], [17]):
            assert streamed(tokenizer, tokens, sizes) == whole
