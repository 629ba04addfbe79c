"""Tiny random-weight vision-language models built from configs, each with a real transformers processor
built from local objects (fp32, no download), so that tests write what users write:

    model, processor = tiny_vlm("qwen2_vl")
    inputs = processor(images=[image(0)], text=[prompt_text("qwen2_vl", 1, "a cat")], return_tensors="pt")
    model.generate(**inputs, max_new_tokens=30, do_sample=False)

or, for a left-padded batch of rows (number of images, words), vlm_inputs(family, rows).

Every family shares one 110-token vocabulary: pad, bos and eos, the special tokens of all the processors
(added as unsplit special tokens), then single characters as in tiny_models.char_tokenizer, with space
and newline. Images are 32 px and give 4 to 16 image tokens each (qwen's follow the image's size: 16 px
gives 4, 48 px 36); the text models have 2 layers of width 64, the vision towers one layer of width 32.

SmolVLM is missing: its processor refuses to be built without the num2words package.
"""

from __future__ import annotations

import functools
import string

import numpy as np
import torch
from tiny_models import CONFIGS, SHARED

PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = (
    "<image>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
)
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
VOCAB = 3 + len(SPECIAL_TOKENS) + len(CHARACTERS)
NOT_WRITTEN = [PAD, BOS, *range(3, 3 + len(SPECIAL_TOKENS))]  # token ids the models never write
IMAGE_SIZE = 32

VLM_FAMILIES: tuple[str, ...] = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm", "paligemma")

# what a user writes where one image goes (paligemma's processor then adds bos after the last image)
PLACEHOLDERS = {
    "llava": "<image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "idefics3": "<image>",
    "smolvlm": "<image>",
    "paligemma": "<image>",
}
NESTED_IMAGES = {"gemma3", "idefics3", "smolvlm", "paligemma"}  # processors given one list of images per row
IMAGES_REQUIRED = {"paligemma"}  # processors that cannot take a row without an image


def token_id(token: str) -> int:
    return 3 + SPECIAL_TOKENS.index(token)


def vlm_tokenizer(add_bos: bool = True, **named_tokens: str):
    """A fresh character tokenizer (processors add tokens to theirs) padding on the left, with the
    special tokens unsplit; named_tokens (image_token="<image>", ...) become attributes with ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *SPECIAL_TOKENS, *CHARACTERS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=list(SPECIAL_TOKENS),
        add_bos_token=add_bos,
        padding_side="left",
        **named_tokens,
    )


# the tiny llama of tiny_models (2 layers, 64 wide) over this vocabulary
TEXT = dict(CONFIGS["llama"], vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=IMAGE_SIZE)
PATCH = 8  # 32 px images: 4 x 4 patches


def _llava():
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    config = LlavaConfig(  # 16 image tokens: "default" drops CLIP's class token
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(VISION, model_type="clip_vision_model", patch_size=PATCH, projection_dim=32),
        image_token_index=token_id("<image>"),
        image_seq_length=16,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    square = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=square),
        tokenizer=vlm_tokenizer(),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=None,
    )
    return config, processor


def _qwen_vl(family: str):
    """Qwen2-VL or Qwen2.5-VL: patches of 4 px merged 2 x 2, so a 32 px image is 16 image tokens;
    the image processor keeps sizes between 16 and 48 px (4 to 36 tokens)."""
    import transformers

    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[family]
    patch, merge = 4, 2
    vision = dict(depth=1, num_heads=2, patch_size=patch, spatial_merge_size=merge, temporal_patch_size=2)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=TEXT["hidden_size"])
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"])
        vision.update(window_size=16, fullatt_block_indexes=[0])
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # head_dim 16: 8 frequencies
    config = getattr(transformers, f"{name}Config")(
        text_config=dict(TEXT, rope_parameters=rope),
        vision_config=vision,
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
    processor = _without_video(getattr(transformers, f"{name}Processor"))
    processor.__init__(image_processor=images, tokenizer=vlm_tokenizer(add_bos=False), chat_template=None)
    return config, processor


def _without_video(processor_cls):
    """An instance of processor_cls, not yet initialised, that accepts no video processor. Qwen's
    processors require one, and its base class (BaseVideoProcessor) exists only where torchvision is
    installed; the image path never touches it."""
    processor = processor_cls.__new__(processor_cls)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = lambda name, arg: (
        None if name == "video_processor" and arg is None else check(name, arg)
    )
    return processor


def _gemma3():
    from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    tokens_per_image = 4  # the 4 x 4 patches pooled 2 x 2
    text = dict(
        TEXT,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(VISION, model_type="siglip_vision_model", patch_size=PATCH, vision_use_head=False),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=token_id("<start_of_image>"),
        eoi_token_index=token_id("<end_of_image>"),
        image_token_index=token_id("<image_soft_token>"),
    )
    tokenizer = vlm_tokenizer(
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=None,
    )
    return config, processor


def _idefics3():
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    scale = 2  # the 4 x 4 patches pixel-shuffled 2 x 2 into 4 image tokens
    config = Idefics3Config(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(VISION, patch_size=PATCH),
        scale_factor=scale,
        image_token_id=token_id("<image>"),
        pad_token_id=PAD,
    )
    edge = {"longest_edge": IMAGE_SIZE}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False),
        tokenizer=vlm_tokenizer(),
        image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // scale**2,
        chat_template=None,
    )
    return config, processor


def _smolvlm():
    """SmolVLM: Idefics3's layout under its own classes (its processor needs num2words)."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil, SmolVLMProcessor

    scale = 2
    config = SmolVLMConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(VISION, model_type="smolvlm_vision", patch_size=PATCH),
        scale_factor=scale,
        image_token_id=token_id("<image>"),
        pad_token_id=PAD,
    )
    edge = {"longest_edge": IMAGE_SIZE}
    processor = _without_video(SmolVLMProcessor)
    processor.__init__(
        image_processor=SmolVLMImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False),
        tokenizer=vlm_tokenizer(),
        video_processor=None,
        image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // scale**2,
        chat_template=None,
    )
    return config, processor


def _paligemma():
    from transformers import PaliGemmaConfig, PaliGemmaProcessor, SiglipImageProcessorPil

    config = PaliGemmaConfig(  # 16 image tokens
        text_config=dict(TEXT, model_type="gemma", head_dim=16),
        vision_config=dict(VISION, model_type="siglip_vision_model", patch_size=PATCH, vision_use_head=False),
        image_token_index=token_id("<image>"),
        projection_dim=TEXT["hidden_size"],
        hidden_size=TEXT["hidden_size"],
        vocab_size=VOCAB,
    )
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = (IMAGE_SIZE // PATCH) ** 2
    # the processor turns bos off and writes it into the text, after the images
    tokenizer = vlm_tokenizer(add_bos=False, image_token="<image>")
    return config, PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=None)


BUILDERS = {
    "llava": _llava,
    "qwen2_vl": lambda: _qwen_vl("qwen2_vl"),
    "qwen2_5_vl": lambda: _qwen_vl("qwen2_5_vl"),
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "smolvlm": _smolvlm,
    "paligemma": _paligemma,
}
SHARPEN = {  # family -> (weight scale, scale the embeddings too): the least degenerate outputs found
    "llava": (5.0, True),
    "qwen2_vl": (4.0, True),
    "qwen2_5_vl": (5.0, True),
    "gemma3": (3.0, False),  # gemma scales its embeddings itself, as in tiny_models
    "idefics3": (3.5, True),
    "smolvlm": (3.5, True),
    "paligemma": (7.0, False),
}


@functools.cache
def tiny_vlm(family: str, seed: int = 0):
    """(model, processor) for one of VLM_FAMILIES; the model is shared (a test changes a copy)."""
    from transformers import AutoModelForImageTextToText

    config, processor = BUILDERS[family]()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    _sharpen_text(model, *SHARPEN[family])
    SHARED.append(model.eval())
    return model, processor


def _sharpen_text(model, scale: float, embeddings: bool):
    """Sharper-than-default text weights give the model habits (repeated phrases), as in tiny_models.
    The output rows of pad, bos and the special tokens are zeroed: a zero logit is below the best
    of the sharpened ones, so the model writes characters or eos, never an image token. A head tied
    to the input embeddings is untied first, so that those tokens keep their input embeddings (a
    zero embedding would make a token blind to positions, and the model check probes with them)."""
    output = model.get_output_embeddings()
    with torch.no_grad():
        for name, param in model.get_decoder().named_parameters():
            if param.dim() >= 2 and (embeddings or "embed" not in name):
                param.mul_(scale)
        if output.weight is model.get_input_embeddings().weight:
            output.weight = torch.nn.Parameter(output.weight.detach().clone())
            model.config.tie_word_embeddings = False
        else:
            output.weight.mul_(scale)
        output.weight[NOT_WRITTEN] = 0


def image(seed: int, size: int | tuple[int, int] | None = None):
    """A random RGB image, IMAGE_SIZE square unless size (a side, or (width, height)) says otherwise."""
    from PIL import Image

    width, height = size if isinstance(size, tuple) else (size or IMAGE_SIZE,) * 2
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def prompt_text(family: str, n_images: int, words: str) -> str:
    """The text a user passes with n_images images: the family's placeholder once per image, then words."""
    return PLACEHOLDERS[family] * n_images + words


def vlm_inputs(family: str, rows: list[tuple[int, str]], seed: int = 0):
    """The processor's left-padded batch (a BatchFeature of tensors) for rows of (number of images,
    words), the images drawn from seed on. A row of 0 images is text only; every family batches those
    with image rows except paligemma, whose processor refuses text only and, in a mixed batch, writes
    bos into the words of a row without an image: for it such a row raises a ValueError here."""
    if family in IMAGES_REQUIRED and any(n == 0 for n, _ in rows):
        raise ValueError(f"{family}'s processor cannot take a row without an image")
    _, processor = tiny_vlm(family)
    processor.tokenizer.padding_side = "left"
    texts = [prompt_text(family, n, words) for n, words in rows]
    counts = [n for n, _ in rows]
    pictures = [image(seed + i) for i in range(sum(counts))]
    if not pictures:
        return processor(text=texts, return_tensors="pt", padding=True)
    if family in NESTED_IMAGES:
        starts = np.cumsum([0, *counts]).tolist()
        pictures = [pictures[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return processor(images=pictures, text=texts, return_tensors="pt", padding=True)
