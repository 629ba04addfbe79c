"""Where a step's positions reach past t: the end of a learned position table, and rotary
embeddings whose frequencies depend on a forward pass's highest position (transformers'
"longrope" and "dynamic" RoPE). A plain step's frequencies depend on t's position alone, so a wider
step must not reach a position that changes them. Tiny random-weight models, fp32; weights scaled
up so that a change of rotary frequencies changes the text."""

import pytest
import torch
from tiny_models import COMMON, CONFIGS, repetitive_prompt, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from lookahead import Lookahead
from lookahead.support import UnsupportedModelError, check_model

SETTINGS = [Lookahead(4, 4, 4), Lookahead(0, 4, 4), Lookahead()]


def _rope_model(arch: str, rope: dict, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**COMMON, **CONFIGS[arch], **overrides}, rope_parameters=rope)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(6.0)
    return model.eval()


def longrope(original: int = 32):
    half = CONFIGS["phi3"]["hidden_size"] // CONFIGS["phi3"]["num_attention_heads"] // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }
    return _rope_model("phi3", rope, original_max_position_embeddings=original)


def dynamic(table: int = 32):
    return _rope_model("llama", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                       max_position_embeddings=table)  # fmt: skip


@pytest.mark.parametrize("make", [longrope, dynamic])
def test_one_sequence_crossing_a_rope_threshold_matches_generate(make):
    """Phi-3's generate also recomputes the whole cache when the text reaches the threshold
    (its ``prepare_inputs_for_generation`` drops the cache there): lookahead does the same."""
    model = make()
    spec = check_model(model)
    assert spec.rope_threshold == 32
    assert spec.refill_at == (32 if make is longrope else None)
    accepted = 0
    for seed, length in ((0, 24), (1, 24), (2, 24), (3, 32)):  # 30 new tokens: each crosses position 32
        prompt = repetitive_prompt(length, seed=seed)
        expected = model.generate(prompt, max_new_tokens=30, eos_token_id=None)
        for la in SETTINGS:
            got = model.generate(prompt, max_new_tokens=30, eos_token_id=None, custom_generate=la)
            assert torch.equal(got, expected), (make.__name__, seed, la)
            accepted += sum(la.last_stats.accepted_hist[1:])
    assert accepted > 0  # candidates were accepted: the steps were wide, not all plain


def test_a_batch_that_would_cross_a_rope_threshold_is_refused_and_one_below_it_matches():
    model = longrope()
    prompts = [repetitive_prompt(12, seed=1)[0], repetitive_prompt(9, seed=2)[0]]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = prompts[0], 1
    ids[1, 3:], mask[1, 3:] = prompts[1], 1
    with pytest.raises(ValueError, match="one at a time, or keep max_length at most 32"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, custom_generate=Lookahead(0, 4, 4))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_length=32, eos_token_id=None)
    for la in SETTINGS:
        got = model.generate(input_ids=ids, attention_mask=mask, max_length=32, eos_token_id=None, custom_generate=la)
        assert torch.equal(got, expected), la


def test_a_batch_reaching_the_end_of_a_learned_position_table_matches_generate():
    """GPT-2's 256 positions: the sequence nearer the end gets no candidates of its own, but
    carries the other's filler slots, whose positions must stay inside the table."""
    model = tiny_model("gpt2")
    ids = torch.zeros(2, 230, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = repetitive_prompt(230, seed=230)[0], 1
    ids[1, 7:], mask[1, 7:] = repetitive_prompt(223, seed=1)[0], 1
    expected = model.generate(input_ids=ids, attention_mask=mask, max_length=256)
    for la in (Lookahead(4, 4, 4), Lookahead(0, 4, 4)):
        got = model.generate(input_ids=ids, attention_mask=mask, max_length=256, custom_generate=la)
        assert torch.equal(got, expected), la


def test_a_prompt_as_long_as_the_position_table_still_gets_its_token():
    """256 tokens fill GPT-2's table: plain generate still emits the token that the last position
    predicts, and so does lookahead; 257 are refused by name."""
    model = tiny_model("gpt2")
    prompt = repetitive_prompt(256, seed=3)
    expected = model.generate(prompt, max_new_tokens=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=1, custom_generate=Lookahead()), expected)
    with pytest.raises(ValueError, match="257 tokens but the model takes at most 256 positions"):
        model.generate(repetitive_prompt(257, seed=3), max_new_tokens=1, custom_generate=Lookahead())


def test_a_server_limits_a_longrope_model_s_requests_to_its_threshold(caplog):
    """A server's batch mixes requests at any positions; past the threshold one request's positions
    would switch the others' factors, so requests are held below it, and the start says so."""
    import logging

    from lookahead import LookaheadConfig
    from lookahead.api import ApiError, parse_request
    from lookahead.service import Service

    with caplog.at_level(logging.WARNING, logger="lookahead"):
        service = Service(longrope(), LookaheadConfig(0, 4, 4), max_batch_size=2)
    try:
        assert service.spec.context_limit == 32 and "limited to 32 tokens" in caplog.text
        body = {"model": "m", "prompt": list(range(3, 23)), "max_tokens": 13}  # 20 + 13 > 32
        with pytest.raises(ApiError, match="at most 12"):
            parse_request(body, False, "m", None, service.spec.context_limit, 16, 96)
    finally:
        service.shutdown(timeout=30)


@pytest.mark.parametrize("arch, table", [("gpt2", 256), ("opt", 256), ("llama", None), ("phi3", None)])
def test_only_a_learned_position_table_limits_positions(arch, table):
    """GPT-2's wpe and OPT's learned positions end; rotary embeddings compute any position."""
    assert check_model(tiny_model(arch)).position_table == table


@pytest.mark.parametrize("make", [lambda: tiny_model("llama"), lambda: longrope(32)], ids=["rope", "longrope"])
def test_a_rope_model_runs_past_max_position_embeddings_as_generate_does(make):
    """A 600-token prompt on a model whose max_position_embeddings is 512: plain generate runs it
    (with a warning), and so does lookahead, with wide steps past position 512."""
    model = make()
    assert model.config.max_position_embeddings == 512
    prompt = repetitive_prompt(600, seed=5)
    expected = model.generate(prompt, max_new_tokens=24, eos_token_id=None)
    la = Lookahead(0, 4, 4)
    got = model.generate(prompt, max_new_tokens=24, eos_token_id=None, custom_generate=la)
    assert torch.equal(got, expected)
    assert sum(la.last_stats.accepted_hist[1:]) > 0  # candidates accepted past position 512


@pytest.mark.parametrize(
    "rope, t_position, highest",
    [
        # (RoPE kind, t's position, the highest position its step may reach); threshold 32
        ("longrope", 20, 31),  # below the threshold: stay below it
        ("longrope", 32, None),  # past it the long factors are fixed: any width
        ("dynamic", 20, 31),
        ("dynamic", 32, 32),  # past it every new highest position rescales: t alone
        ("dynamic", 40, 40),
    ],
)
def test_steps_past_a_rope_threshold_are_wide_unless_the_rope_is_dynamic(rope, t_position, highest):
    model = longrope() if rope == "longrope" else dynamic()
    assert check_model(model).position_limit(t_position) == highest


def _left_padded(prompt: torch.Tensor, pads: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.zeros(1, pads, dtype=torch.long), prompt], dim=1)
    mask = (torch.arange(ids.shape[1]) >= pads).long()[None]
    return ids, mask


@pytest.mark.parametrize("pads, length", [(4, 20), (2, 28), (1, 31)])
def test_one_left_padded_prompt_crossing_a_longrope_threshold_matches_generate(pads, length):
    """Phi-3's generate recomputes its cache where the text *with its padding* reaches 33 tokens,
    before its positions reach 32 (the same short factors: nothing changes); at position 32 the long
    factors key the new tokens only. Lookahead must not recompute at position 32 then."""
    model = longrope()
    ids, mask = _left_padded(repetitive_prompt(length, seed=3), pads)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    expected = model.generate(**kwargs)
    for la in SETTINGS:
        assert torch.equal(model.generate(**kwargs, custom_generate=la), expected), la


def _asks(model, prepare) -> None:
    """Replace the model's prepare_inputs_for_generation, the method the model check asks."""
    model.prepare_inputs_for_generation = prepare.__get__(model)


@pytest.mark.parametrize("error", [RuntimeError("out of memory"), TypeError("'NoneType' object is not subscriptable")])
def test_a_model_check_that_fails_is_surfaced_not_taken_as_keeping_the_cache(error):
    """Whether Phi-3's generate recomputes its cache at the threshold is asked of the model; a failure
    there means lookahead cannot know, so it refuses, naming the model and the error."""
    model = longrope()

    def prepare(self, input_ids, **kwargs):
        raise error

    _asks(model, prepare)
    with pytest.raises(UnsupportedModelError, match=f"Phi3ForCausalLM.*{type(error).__name__}: {error}"):
        check_model(model)


def test_a_model_whose_signature_cannot_take_the_check_keeps_its_cache_with_a_warning(caplog):
    """A prepare_inputs_for_generation that needs inputs of its own cannot be asked: taken to keep its
    cache, as before, and the log says so."""
    import logging

    model = longrope()

    def prepare(self, input_ids, pixel_values, cache=None, attention_mask=None, next_sequence_length=None):
        raise AssertionError("never called")

    _asks(model, prepare)
    with caplog.at_level(logging.WARNING, logger="lookahead"):
        assert check_model(model).refill_at is None
    assert "cannot be asked whether it recomputes its cache at position 32" in caplog.text
