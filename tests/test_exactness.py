"""The headline invariant: lookahead output == model.generate(do_sample=False), token for token.

Tiny random-weight models of nine architectures, fp32, several (W, N, G) including the edges.
Each case also counts forward passes, so that the multi-token (acceptance) path is proven to run.
"""

import copy
import dataclasses

import pytest
import torch
from tiny_models import CONFIGS, repetitive_prompt, tiny_model

from lookahead import Lookahead
from lookahead.support import check_model

SETTINGS = [(4, 4, 4), (5, 3, 5), (2, 2, 3), (1, 3, 2), (3, 5, 0), (0, 4, 4)]
NEW_TOKENS = 40


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "W{}N{}G{}".format(*s))
def test_matches_greedy(arch, setting, count_forwards):
    model = tiny_model(arch)
    check_model(model)  # the one-time probe, outside the forward count
    steps = new = 0
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        lookahead = Lookahead(*setting)
        counter = count_forwards(model)
        got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=lookahead)
        counter.close()
        assert got.tolist() == expected.tolist(), f"{arch} {setting} prompt {seed}"
        stats = lookahead.last_stats
        assert counter.count == stats.steps  # one forward pass per step, the prefill included
        assert stats.new_tokens == got.shape[1] - prompt.shape[1]
        steps, new = steps + stats.steps, new + stats.new_tokens
    if setting[2] == 0:
        assert steps == new  # no candidates: exactly one token per step
    else:
        assert steps < new, f"no multi-token step happened for {arch} {setting}"


def test_sliding_window_mask_matters():
    """Past the window, gemma3's sliding layers must get their own mask: a single full mask
    would let them see too far back and change the output."""
    from lookahead import support

    model = tiny_model("gemma3_text")
    prompt = repetitive_prompt(30, 1)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = check_model(model)
    assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == 8
    full_only = dataclasses.replace(spec, layer_types=("full_attention",), sliding_window=None)
    support._checked[model] = (support._checked[model][0], full_only)
    try:
        wrong = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    finally:
        support._checked.pop(model)
    assert wrong.tolist() != expected.tolist()
    right = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    assert right.tolist() == expected.tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_max_new_tokens_is_exact(max_new_tokens):
    model = tiny_model("llama")
    prompt = repetitive_prompt(24, 0)
    expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    got = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    assert got.tolist() == expected.tolist()
    assert got.shape[1] == prompt.shape[1] + max_new_tokens


def test_one_token_prompt():
    model = tiny_model("qwen2")
    prompt = torch.tensor([[1]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    got = model.generate(prompt, max_new_tokens=20, do_sample=False, custom_generate=Lookahead(3, 3, 3))
    assert got.tolist() == expected.tolist()


def test_left_padded_single_prompt():
    model = tiny_model("llama")
    prompt = repetitive_prompt(20, 2)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    expected = model.generate(padded, attention_mask=mask, max_new_tokens=30, do_sample=False)
    got = model.generate(
        padded, attention_mask=mask, max_new_tokens=30, do_sample=False, custom_generate=Lookahead(4, 4, 4)
    )
    assert got.tolist() == expected.tolist()


def test_long_generation_with_learned_positions_near_the_table_end():
    """gpt2 has a 256-entry position table: the window must never reach past it."""
    model = tiny_model("gpt2")
    prompt = repetitive_prompt(200, 3)
    expected = model.generate(prompt, max_new_tokens=56, do_sample=False)
    got = model.generate(prompt, max_new_tokens=56, do_sample=False, custom_generate=Lookahead(5, 4, 4))
    assert got.tolist() == expected.tolist()
    assert got.shape[1] == 256


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_token_trees_match_greedy(arch, monkeypatch):
    """Candidates sharing a prefix, verified as a token tree (one row per distinct prefix), give
    the same output as greedy and as the same candidates on rows of their own; and the tree does
    save rows on these prompts."""
    from lookahead.runner import DecoderRunner

    steps = []
    original = DecoderRunner.step

    def step(self, layout, step_ids):
        steps.append((sum(len(c) for c in layout.candidate_slots), len(layout.node_slots)))
        return original(self, layout, step_ids)

    monkeypatch.setattr(DecoderRunner, "step", step)
    model = tiny_model(arch)
    saved = dict.fromkeys([((0, 4, 6), True), ((0, 4, 6), False), ((3, 3, 5), True), ((3, 3, 5), False)], 0)
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        for setting, tree in saved:
            steps.clear()
            lookahead = Lookahead(*setting, token_tree=tree)
            got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=lookahead)
            assert got.tolist() == expected.tolist(), f"{arch} {setting} tree={tree} prompt {seed}"
            saved[setting, tree] += sum(tokens - nodes for tokens, nodes in steps)
    for (setting, tree), rows in saved.items():
        assert rows > 0 if tree else rows == 0, (arch, setting, tree, rows)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "gemma3_text", "phi3"])
def test_eager_attention_matches_greedy(arch):
    """The README promises eager attention as well as sdpa: the same invariant, eager kernels."""
    model = copy.deepcopy(tiny_model(arch))
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    for setting in [(4, 4, 4), (0, 4, 4)]:
        for seed in range(2):
            prompt = repetitive_prompt(24, seed)
            expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            lookahead = Lookahead(*setting)
            got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=lookahead)
            assert got.tolist() == expected.tolist(), f"{arch} {setting} prompt {seed}"
            assert lookahead.last_stats.steps < lookahead.last_stats.new_tokens


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_layers_keep_a_bounded_cache_over_a_long_generation(arch):
    """Sliding-window layers drop what no window reaches again: over 400 new tokens their cache
    stays within the window plus a step, while full-attention layers hold every token; the
    output stays exact."""
    model = tiny_model(arch)
    spec = check_model(model)
    window, sliding = spec.sliding_window, spec.sliding_layers(model.config)
    assert sliding
    prompt = repetitive_prompt(24, 4)
    expected = model.generate(prompt, max_new_tokens=400, do_sample=False)
    lengths = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is not None and cache.layers and cache.layers[0].is_initialized:
            lengths.append([layer.keys.shape[2] for layer in cache.layers])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = model.generate(prompt, max_new_tokens=400, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    finally:
        handle.remove()
    assert got.tolist() == expected.tolist()
    longest = [max(step[i] for step in lengths) for i in range(len(lengths[0]))]
    for i, most in enumerate(longest):
        if i in sliding:
            assert most < window + 8, (i, most)  # the window, plus a step's committed tokens
        else:
            assert most >= expected.shape[1] - 8, (i, most)  # full attention keeps everything
