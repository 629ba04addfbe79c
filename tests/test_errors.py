"""Bad input and unsupported models get a clear error before any decoding, and nothing is lost."""

import pytest
import torch
from tiny_models import COMMON, repetitive_prompt, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, SynthIDTextWatermarkingConfig

from lookahead import Lookahead, LookaheadConfig, UnsupportedModelError


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window_size=-1), r"window_size \(W\) must be an integer >= 0"),
        (dict(ngram_size=1), r"ngram_size \(N\) must be an integer >= 2"),
        (dict(max_candidates=-2), r"max_candidates \(G\) must be an integer >= 0"),
        (dict(window_size=2.5), r"window_size \(W\)"),
        (dict(ngram_size=True), r"ngram_size \(N\)"),
        (dict(max_candidates="4"), r"max_candidates \(G\)"),
    ],
)
def test_invalid_settings_say_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lookahead(**kwargs)
    with pytest.raises(ValueError, match=match):
        LookaheadConfig(**{"window_size": 4, "ngram_size": 4, "max_candidates": 4, **kwargs})


def test_default_is_valid_and_overridable():
    la = Lookahead(ngram_size=3)
    cfg = la.config_for("cpu")
    assert cfg.ngram_size == 3 and cfg.window_size >= 0 and cfg.max_candidates >= 0
    assert la.config_for("cuda").window_size >= cfg.window_size


def generate(model, prompt, **kwargs):
    return model.generate(prompt, custom_generate=Lookahead(4, 4, 4), **{"max_new_tokens": 5, **kwargs})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_beams=2, constraints=None, force_words_ids=[[5]]), "constrained beam search"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
        # with a custom_generate callable transformers runs neither itself: never silently greedy
        (dict(penalty_alpha=0.6, top_k=4), r"contrastive search \(penalty_alpha\)"),
        (dict(dola_layers="high"), r"DoLa \(dola_layers\)"),
    ],
)
def test_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_model("llama"), repetitive_prompt(), **kwargs)


def test_num_return_sequences_reaches_lookahead_only_when_sampling():
    """transformers refuses num_return_sequences > 1 without sampling before the callable runs.
    Sampled, it hands lookahead the prompt repeated: each returned sequence is then drawn with a
    seed of its own, as the rows of that repeated batch are under the same torch seed."""
    model, prompt = tiny_model("llama"), repetitive_prompt(16, 1)
    lookahead, batches = Lookahead(4, 4, 4), []

    def loop(model, input_ids, *args, **kwargs):
        batches.append(input_ids.shape[0])
        return lookahead(model, input_ids, *args, **kwargs)

    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(prompt, do_sample=False, num_return_sequences=2, max_new_tokens=5, custom_generate=loop)
    assert batches == []  # transformers' own check: lookahead has none to make
    kwargs = dict(do_sample=True, max_new_tokens=12, custom_generate=loop)
    torch.manual_seed(3)
    got = model.generate(prompt, num_return_sequences=3, **kwargs)
    assert batches == [3] and lookahead.last_stats.batch_size == 3
    torch.manual_seed(3)
    assert got.tolist() == model.generate(prompt.repeat(3, 1), **kwargs).tolist()
    assert len({tuple(row) for row in got[:, prompt.shape[1] :].tolist()}) == 3  # three draws, not one


def test_what_generate_keeps_from_a_callable_is_refused_where_lookahead_sees_it():
    """transformers hands a custom_generate callable neither synced_gpus nor the tokenizer that
    token healing needs: Lookahead().generate, which sees the arguments, refuses them by name."""
    model, prompt = tiny_model("llama"), repetitive_prompt()
    with pytest.raises(ValueError, match="synced_gpus"):
        Lookahead(4, 4, 4).generate(model, prompt, max_new_tokens=5, synced_gpus=True)
    with pytest.raises(ValueError, match=r"model.heal_tokens\(input_ids, tokenizer\)"):
        Lookahead(4, 4, 4).generate(model, prompt, max_new_tokens=5, token_healing=True, tokenizer=object())


def test_inputs_embeds_alone_gets_its_own_message():
    model, prompt = tiny_model("llama"), repetitive_prompt()
    embeds = model.get_input_embeddings()(prompt)
    with pytest.raises(ValueError, match="needs input_ids, not inputs_embeds"):
        model.generate(inputs_embeds=embeds, max_new_tokens=5, custom_generate=Lookahead(4, 4, 4))


def test_right_padding_is_refused():
    prompt = repetitive_prompt(12, 0)
    mask = torch.ones_like(prompt)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        generate(tiny_model("llama"), prompt, attention_mask=mask)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model("llama"), torch.zeros(1, 0, dtype=torch.long))
    padded = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model("llama"), padded, attention_mask=torch.zeros_like(padded))


def test_too_long_prompt_is_refused():
    model = tiny_model("gpt2")  # 256 positions
    with pytest.raises(ValueError, match="at most 256 positions"):
        generate(model, repetitive_prompt(300))


def test_zero_new_tokens_is_refused_as_transformers_does():
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model("llama"), repetitive_prompt(), max_new_tokens=0)


def test_filled_cache_is_refused():
    from transformers import DynamicCache

    model = tiny_model("llama")
    cache = DynamicCache()
    model(repetitive_prompt(8), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="empty cache"):
        generate(model, repetitive_prompt(12), cache=cache)


@pytest.mark.parametrize(
    "arch, sizes",
    [
        ("mamba", dict(state_size=4, num_hidden_layers=1)),
        # a hybrid: one Mamba layer, one attention layer; its recurrent layer is enough to refuse it
        (
            "jamba",
            dict(
                num_hidden_layers=2,
                attn_layer_period=2,
                attn_layer_offset=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                intermediate_size=32,
                num_experts=2,
                mamba_d_state=4,
                mamba_expand=1,
            ),
        ),
    ],
)
def test_state_space_model_is_refused(arch, sizes):
    config = AutoConfig.for_model(arch, vocab_size=64, hidden_size=32, **sizes)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="state-space"):
        model.generate(torch.tensor([[5, 6, 7]]), custom_generate=Lookahead(), max_new_tokens=3)


class MaskIgnoringLlama(LlamaForCausalLM):
    """A model whose attention ignores the attention_mask it is given."""

    def forward(self, *args, attention_mask=None, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


class CachelessLlama(LlamaForCausalLM):
    def forward(self, *args, use_cache=None, cache=None, **kwargs):
        return super().forward(*args, use_cache=False, **kwargs)


@pytest.mark.parametrize(
    "cls,match", [(MaskIgnoringLlama, "ignores custom 4D attention masks"), (CachelessLlama, "KV cache")]
)
def test_models_that_cannot_run_exactly_are_refused(cls, match):
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", **COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = cls(config).eval()
    with pytest.raises(UnsupportedModelError, match=match):
        model.generate(repetitive_prompt(), custom_generate=Lookahead(), max_new_tokens=3)


def test_flash_attention_is_refused():
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", **COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "flash_attention_2"  # as if loaded with it; no GPU needed
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa' or 'eager'"):
        model.generate(repetitive_prompt(), custom_generate=Lookahead(), max_new_tokens=3)


def test_inputs_the_loop_does_not_pass_on_are_refused_by_name():
    model, prompt = tiny_model("llama"), repetitive_prompt()
    with pytest.raises(ValueError, match="token_type_ids"):
        generate(model, prompt, token_type_ids=torch.zeros_like(prompt))
    with pytest.raises(ValueError, match="position_ids"):
        generate(model, prompt, position_ids=torch.arange(prompt.shape[1])[None] + 5)
    # the standard positions are what the loop uses anyway: accepted
    out = generate(model, prompt, position_ids=torch.arange(prompt.shape[1])[None], do_sample=False)
    assert out.tolist() == model.generate(prompt, max_new_tokens=5, do_sample=False).tolist()


def test_stateful_logits_processors_are_refused():
    model, prompt = tiny_model("llama"), repetitive_prompt()
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        generate(model, prompt, guidance_scale=1.5, do_sample=False)
    # SynthID keeps each row's last tokens from call to call: a batch's rows would corrupt each other's
    watermark = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160], ngram_len=3)
    with pytest.raises(ValueError, match="SynthIDTextWatermarkLogitsProcessor"):
        generate(model, prompt, watermarking_config=watermark)
