"""Encoder-decoder models: lookahead in the decoder, token-identical to model.generate.

T5 (relative position bias), BART and Marian (learned / sinusoidal absolute positions), batch 1
and batch 3 with right-padded sources of mixed lengths, multi-token steps asserted.
"""

import logging

import pytest
import torch
from tiny_models import SEQ2SEQ, repetitive_prompt, tiny_seq2seq

from lookahead import Lookahead

SOURCE_LENGTHS = (12, 20, 9)


def sources(lengths, seed=0):
    """Right-padded encoder inputs (as seq2seq tokenizers pad): (input_ids, attention_mask)."""
    rows = [repetitive_prompt(n, seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def decoder_prompts(batch, length=12):
    """Decoder prompts (start token, then a varied motif per row): random seq2seq models left to
    themselves soon repeat one token; a prompt gives the decoder something to continue."""
    motifs = [repetitive_prompt(length, 10 + b)[:, 1:] for b in range(batch)]
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), torch.cat(motifs)], dim=1)


@pytest.mark.parametrize("arch", list(SEQ2SEQ))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("prompted", [False, True], ids=["start-token", "decoder-prompt"])
def test_seq2seq_matches_greedy(arch, batch, prompted):
    model = tiny_seq2seq(arch)
    ids, mask = sources(SOURCE_LENGTHS[:batch], seed=batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    if prompted:
        kwargs["decoder_input_ids"] = decoder_prompts(batch)
    expected = model.generate(ids, **kwargs)
    lookahead = Lookahead(0, 4, 1)
    got = lookahead.generate(model, ids, **kwargs)
    assert got.tolist() == expected.tolist(), f"{arch} batch {batch}"
    stats = lookahead.last_stats
    assert stats.sequence_steps < stats.new_tokens and sum(stats.accepted_hist[1:]) > 0, "no multi-token step"


@pytest.mark.parametrize("arch", list(SEQ2SEQ))
def test_seq2seq_plain_generate_call_and_auto_settings(arch):
    """model.generate(custom_generate=Lookahead()) works too (without the source pooled)."""
    model = tiny_seq2seq(arch)
    ids, mask = sources(SOURCE_LENGTHS, seed=4)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    lookahead = Lookahead()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, custom_generate=lookahead)
    assert got.tolist() == expected.tolist()
    assert lookahead.last_stats.config.window_size == 0 and lookahead.last_stats.config.max_candidates == 1


def test_wider_settings_are_narrowed_with_a_warning(caplog):
    model = tiny_seq2seq("bart")
    ids, mask = sources(SOURCE_LENGTHS[:2])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    lookahead = Lookahead(4, 4, 4)
    with caplog.at_level(logging.WARNING, logger="lookahead"):
        got = lookahead.generate(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert got.tolist() == expected.tolist()
    assert "W=0 and G<=1" in caplog.text
    assert (lookahead.last_stats.config.window_size, lookahead.last_stats.config.max_candidates) == (0, 1)


def test_seq2seq_rows_stopping_early_are_padded():
    model = tiny_seq2seq("bart")
    ids, mask = sources(SOURCE_LENGTHS, seed=6)
    prompts = decoder_prompts(3)
    kwargs = dict(attention_mask=mask, decoder_input_ids=prompts, max_new_tokens=30, do_sample=False)
    plain = model.generate(ids, **kwargs)[:, prompts.shape[1] :]
    eos = int(plain[0, 0])  # row 0 stops at once; the others later or never
    expected = model.generate(ids, eos_token_id=eos, pad_token_id=1, **kwargs)
    got = Lookahead(0, 4, 1).generate(model, ids, eos_token_id=eos, pad_token_id=1, **kwargs)
    new = expected[:, prompts.shape[1] :]
    assert (new[0, 1:] == 1).all() and new.shape[1] > 2  # row 0 padded while the others went on
    assert got.tolist() == expected.tolist()


def test_returned_cache_holds_exactly_the_committed_tokens():
    model = tiny_seq2seq("t5")
    ids, mask = sources(SOURCE_LENGTHS[:1])
    out = Lookahead(0, 4, 1).generate(
        model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, return_dict_in_generate=True
    )
    assert out.cache.self_attention_cache.get_seq_length() == out.sequences.shape[1] - 1
    assert out.cache.cross_attention_cache.get_seq_length() == ids.shape[1]


def test_cli_takes_a_seq2seq_checkpoint(tmp_path, capsys):
    from tiny_models import char_tokenizer

    from lookahead.cli import main

    tiny_seq2seq("bart").save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    code = main(["generate", "abcabcabcabc", "--model", str(tmp_path), "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical" in out and "[lookahead W=0 N=4 G=1]" in out


def test_seq2seq_row_stopping_inside_an_accepted_chain():
    """T5, EOS 95: one row stops in the middle of a multi-token step while the others commit the
    whole step (this crashed the aligned runner once)."""
    model = tiny_seq2seq("t5")
    ids, mask = sources(SOURCE_LENGTHS, seed=6)
    kwargs = dict(attention_mask=mask, decoder_input_ids=decoder_prompts(3), max_new_tokens=30, do_sample=False)
    expected = model.generate(ids, eos_token_id=95, pad_token_id=1, **kwargs)
    got = Lookahead(0, 4, 1).generate(model, ids, eos_token_id=95, pad_token_id=1, **kwargs)
    assert got.tolist() == expected.tolist()


def ngrams(row, shortest=3, longest=4):
    """The row's n-grams of ``shortest`` to ``longest`` tokens (shorter ones recur by chance)."""
    return {tuple(row[i : i + n]) for n in range(shortest, longest + 1) for i in range(len(row) - n + 1)}


def test_lookahead_generate_pools_each_returned_sequence_s_own_source():
    """num_return_sequences expands the batch after Lookahead().generate saw the encoder input:
    each of the 3 returned sequences of a source drafts from that source, exactly as the same
    source repeated in the batch by hand does, and never from the other source."""
    model = tiny_seq2seq("bart")
    ids, mask = sources((12, 20))
    kwargs = dict(do_sample=True, max_new_tokens=10)
    torch.manual_seed(0)
    expected = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=3, **kwargs)
    lookahead = Lookahead(0, 4, 1, record_candidates=True)
    torch.manual_seed(0)
    got = lookahead.generate(model, ids, attention_mask=mask, num_return_sequences=3, **kwargs)
    assert got.shape[0] == expected.shape[0] == 6
    by_hand = Lookahead(0, 4, 1, record_candidates=True)
    torch.manual_seed(0)
    repeated = by_hand.generate(model, ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0),
                                **kwargs)  # fmt: skip
    assert got.tolist() == repeated.tolist()
    assert lookahead.last_candidates == by_hand.last_candidates
    source = [ngrams(ids[r, : int(mask[r].sum())].tolist()) for r in range(2)]
    only = [source[0] - source[1], source[1] - source[0]]  # the n-grams of one source alone
    from_own = [set(), set()]
    for b, steps in enumerate(lookahead.last_candidates):
        drafted = {c for candidates in steps.values() for c in candidates}
        assert not drafted & only[1 - b // 3], f"sequence {b} drafted from the other source"
        from_own[b // 3] |= drafted & only[b // 3]
    assert all(from_own)  # both sources were drafted from


def test_a_speech_model_s_features_are_not_pooled_as_tokens():
    """Speech2Text's encoder takes float features: passed positionally to Lookahead().generate they
    are the model's input, not token ids to draft from."""
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration

    torch.manual_seed(0)
    config = Speech2TextConfig(
        vocab_size=96, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=200,
        max_target_positions=128, input_feat_per_channel=16, num_conv_layers=2, conv_channels=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    model = Speech2TextForConditionalGeneration(config).eval()
    features = torch.randn(1, 40, 16)
    expected = model.generate(input_features=features, max_new_tokens=10)
    assert torch.equal(Lookahead(0, 4, 1).generate(model, features, max_new_tokens=10), expected)
