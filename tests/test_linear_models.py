"""Models that take no position_ids (BLOOM's ALiBi) run linear steps exactly, and a model that
silently drops position_ids is caught by the probe instead of giving wrong output."""

import functools

import pytest
import torch
from test_batch import left_padded
from tiny_models import COMMON, repetitive_prompt
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from lookahead import Lookahead, UnsupportedModelError
from lookahead.support import check_model


@functools.cache
def tiny_bloom():
    torch.manual_seed(0)
    config = AutoConfig.for_model("bloom", **COMMON, hidden_size=64, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # habits, as tiny_models does: candidates then get accepted
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(6.0)
    return model.eval()


def test_bloom_is_run_with_linear_steps():
    spec = check_model(tiny_bloom())
    assert not spec.positions and spec.linear


@pytest.mark.parametrize("setting", [None, (0, 4, 1), (4, 5, 4)])
def test_bloom_matches_greedy(setting):
    model = tiny_bloom()
    accepted = 0
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        lookahead = Lookahead(*setting) if setting else Lookahead(adaptive=False)
        got = model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist(), (setting, seed)
        cfg = lookahead.last_stats.config
        assert cfg.window_size == 0 and cfg.max_candidates <= 1  # settled to linear steps
        accepted += sum(lookahead.last_stats.accepted_hist[1:])
    assert accepted > 0


def test_bloom_batch_matches_batched_greedy():
    model = tiny_bloom()
    ids, mask = left_padded((7, 24, 16), seed=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    lookahead = Lookahead(0, 4, 1)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, custom_generate=lookahead)
    assert got.tolist() == expected.tolist()
    assert sum(lookahead.last_stats.accepted_hist[1:]) > 0


class LlamaDroppingPositions(LlamaForCausalLM):
    """A model that takes position_ids and silently ignores them (it numbers tokens by cache length)."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_a_model_ignoring_position_ids_is_refused():
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaDroppingPositions(config).eval()
    with pytest.raises(UnsupportedModelError, match="ignores position_ids"):
        check_model(model)


def test_the_server_engine_runs_bloom_with_linear_steps():
    """The service settles W/N/G for a model without position_ids, as Lookahead() does."""
    import asyncio

    from lookahead import LookaheadConfig
    from lookahead.service import Request, Service

    model, prompt = tiny_bloom(), repetitive_prompt(24, 1)[0].tolist()
    service = Service(model, LookaheadConfig(4, 4, 4))
    assert (service.cfg.window_size, service.cfg.max_candidates) == (0, 1)

    async def one():
        request, tokens = Request(prompt_ids=prompt, max_tokens=30), []
        service.submit(request)
        while True:
            event = await request.events.get()
            tokens += event.tokens
            if event.finish_reason:
                return tokens

    try:
        tokens = asyncio.run(one())
    finally:
        service.shutdown(timeout=30)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert tokens == expected[0, len(prompt) :].tolist()
