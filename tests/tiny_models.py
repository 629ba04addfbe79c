"""Tiny random-weight models built from configs, for exactness tests (fp32, no download)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# architecture -> config overrides; each is a 2-layer model with a 96-token vocabulary
CONFIGS: dict[str, dict] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=16,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    ),
    "gemma3_text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512
    ),
    "opt": dict(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    ),
    # phi3's default pad_token_id (32000) lies outside a small vocabulary
    "phi3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
    ),
}


SHARPEN = {"gemma3_text": (3.0, False)}  # arch -> (weight scale, scale the embeddings too)


SHARED: list = []  # every model tiny_model handed out: tests share them, so none may change one


@functools.cache
def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **{**COMMON, **CONFIGS[arch]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # Sharper-than-default weights give the model habits (repeated phrases), as real models have,
    # so that candidates get accepted and multi-token steps really happen. Gemma scales its
    # embeddings itself; sharpened further, it repeats a single token forever.
    scale, embeddings = SHARPEN.get(arch, (6.0, True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and (embeddings or "embed" not in name):
                param.mul_(scale)
    SHARED.append(model.eval())
    return model


def repetitive_prompt(length: int = 24, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, VOCAB, (6,), generator=gen)
    return torch.cat([torch.tensor([1]), motif.repeat(length // 6 + 1)[: length - 1]])[None]


@functools.cache
def char_tokenizer():
    """A tokenizer whose tokens are single characters, matching the tiny models' vocabulary."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (string.ascii_letters + string.digits + string.punctuation)[: VOCAB - 3]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


# encoder-decoder architectures: (config class name, model class name, overrides)
_BART_LIKE = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=256,
)
SEQ2SEQ: dict[str, tuple[str, str, dict]] = {
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(_BART_LIKE, forced_bos_token_id=None)),
    "marian": ("MarianConfig", "MarianMTModel", _BART_LIKE),
}
SEQ2SEQ_SCALE = {"t5": 6.0, "bart": 6.0, "marian": 1.0}  # the least degenerate outputs found


@functools.cache
def tiny_seq2seq(arch: str, seed: int = 0):
    import transformers

    config_cls, model_cls, overrides = SEQ2SEQ[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        **COMMON, decoder_start_token_id=0, forced_eos_token_id=None, **overrides
    )
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():  # sharpened, as for the decoder-only models, so that outputs repeat
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(SEQ2SEQ_SCALE[arch])
    return model.eval()
