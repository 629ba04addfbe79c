"""Images in the prefill: what a vision-language model's ``generate`` hands over, checked, and
the prefill run with it.

A VLM (LLaVA, Qwen2-VL, Gemma 3, Idefics3/SmolVLM, PaliGemma...) reads its images once: the
prefill merges them into the prompt's placeholder tokens, and every later token is text. So
lookahead's steps need nothing new, with two exceptions that this module captures:

- **The prefill is generate's own.** transformers 5 has already encoded the images
  (``mm_encoder_outputs``) and computed the prompt's positions when it calls ``custom_generate``.
  :class:`MediaPrefill` runs the first forward pass exactly as generate's prefill does, through
  the model's public ``prepare_inputs_for_generation``: the same ``input_ids`` and padding, the
  same image inputs, ``token_type_ids`` (Gemma 3's bidirectional image blocks, PaliGemma's
  prefix), the same positions.
- **Positions may be shifted.** Each text token's position is its index among the row's real
  tokens plus a constant per row: Qwen2-VL's M-RoPE continues after an image at
  ``index + rope_delta`` on each of its three axes, and PaliGemma counts from 1. The prefill
  reads that constant off the positions it passes (``position_shift``), and every step adds it:
  plain decoding extends each axis by one per token, which is the same.

Video and audio inputs are refused by name (``check_media_inputs``): their models need more
than an image in the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# inputs a VLM's prefill takes, beside input_ids, the padding mask and positions
IMAGE_INPUTS = frozenset(
    {
        "pixel_values",  # raw, where the model does not pre-encode them
        "pixel_attention_mask",  # Idefics3 / SmolVLM
        "image_sizes",  # LLaVA-NeXT
        "image_grid_thw",  # Qwen2-VL
        "mm_encoder_outputs",  # what generate encoded from pixel_values before calling us
        "token_type_ids",  # Gemma 3's image blocks, PaliGemma's prefix: masks of the prefill
        "mm_token_type_ids",  # Qwen2-VL's image tokens (for its positions)
    }
)
# inputs of modalities lookahead does not take yet: name -> modality
REFUSED_INPUTS = {
    "pixel_values_videos": "video",
    "video_grid_thw": "video",
    "second_per_grid_ts": "video",
    "input_features": "audio",
    "input_values": "audio",
    "input_features_mask": "audio",
    "feature_attention_mask": "audio",
    "audio_values": "audio",
}


def takes_images(model) -> bool:
    """Whether ``model`` is a vision-language model (transformers' ``input_modalities``)."""
    return "image" in tuple(getattr(model, "input_modalities", ()) or ())


def check_media_inputs(model, model_kwargs: dict) -> None:
    """Refuse, by name, inputs of a modality lookahead does not take (video, audio), and image
    inputs given to a model that does not read images."""
    for name, value in model_kwargs.items():
        if value is None:
            continue
        if name in REFUSED_INPUTS:
            raise ValueError(
                f"lookahead decoding does not take {REFUSED_INPUTS[name]} inputs yet ({name}): "
                "use plain generate for them"
            )
        if name == "mm_encoder_outputs":
            others = sorted(k for k, v in value.items() if v is not None and k != "image")
            if others:
                raise ValueError(
                    f"lookahead decoding takes image inputs only, not {', '.join(others)}: use plain generate for them"
                )
    if not takes_images(model):
        given = sorted(k for k in IMAGE_INPUTS - {"token_type_ids"} if model_kwargs.get(k) is not None)
        if given:
            raise ValueError(f"{type(model).__name__} does not read images, yet {', '.join(given)} were given")


@dataclass
class MediaPrefill:
    """The first forward pass of a VLM's generate: its ``input_ids`` [B, S] (left-padded, image
    placeholders in place), ``attention_mask`` [B, S] or None, ``position_ids`` as generate made
    them ([B, S], or [axes, B, S] for M-RoPE), and the image inputs (``IMAGE_INPUTS``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    inputs: dict

    @classmethod
    def from_call(cls, model, input_ids: torch.Tensor, model_kwargs: dict) -> MediaPrefill | None:
        """The prefill of a ``generate`` call on a VLM (text-only calls too: a model such as
        PaliGemma places its positions its own way); None for other models."""
        if not takes_images(model):
            return None
        inputs = {k: v for k, v in model_kwargs.items() if k in IMAGE_INPUTS and v is not None}
        return cls(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"), inputs)

    @classmethod
    def from_inputs(cls, model, inputs: dict) -> MediaPrefill:
        """The prefill ``model.generate(**inputs)`` would run (``inputs``: a processor's output
        for one request), prepared by generate itself: it encodes the images and computes the
        positions, then hands them to a ``custom_generate`` that keeps them (a server admits
        requests one at a time this way)."""
        return model.generate(**inputs, max_new_tokens=1, do_sample=False, custom_generate=_keep_prefill)

    def run(self, model, cache, keep_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Fill ``cache`` as generate's prefill does -> (last logits [B, V], the rows' position
        shift [B, axes] (None: none), whether positions go as [axes, B, L])."""
        model_inputs = model.prepare_inputs_for_generation(
            self.input_ids,
            cache=cache,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            use_cache=True,
            is_first_iteration=True,
            **self.inputs,
        )
        if keep_logits:
            model_inputs["logits_to_keep"] = 1
        out = model(**model_inputs)
        shift, stacked = position_shift(model_inputs.get("position_ids"), self.attention_mask, self.input_ids.shape)
        return out.logits[:, -1], shift, stacked


def position_shift(
    positions: torch.Tensor | None, attention_mask: torch.Tensor | None, shape: torch.Size
) -> tuple[torch.Tensor | None, bool]:
    """How far each row's positions, as the prefill passed them ([B, S] or [axes, B, S]), sit from
    the row's token indices at its last token -> (shift [B, axes] on the host, or None where
    every shift is 0 and positions are [B, S]; whether they are stacked [axes, B, S])."""
    if positions is None:
        return None, False
    stacked = positions.dim() == 3
    last = (positions if stacked else positions[None])[..., -1].T.cpu()  # [B, axes]
    if attention_mask is None:
        index = torch.full((shape[0],), shape[1] - 1)
    else:
        index = attention_mask.long().sum(dim=1).cpu() - 1  # [B]: left padding, last token real
    shift = last - index[:, None]
    if not stacked and not bool(shift.any()):
        return None, False
    return shift, stacked


def shifted(positions: torch.Tensor, shift: torch.Tensor | None, stacked: bool) -> torch.Tensor:
    """A step's positions [B, L] as the model takes them: plus each row's shift [B, axes], and
    stacked [axes, B, L] where the prefill's were."""
    if shift is None:
        return positions
    moved = positions[None] + shift.T.to(positions.device)[:, :, None]  # [axes, B, L]
    return moved if stacked else moved[0]


def _keep_prefill(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                  streamer=None, **model_kwargs) -> MediaPrefill:  # fmt: skip
    """A ``custom_generate`` that runs nothing: it returns the prefill generate prepared."""
    check_media_inputs(model, model_kwargs)
    return MediaPrefill.from_call(model, input_ids, model_kwargs)
