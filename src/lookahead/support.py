"""What a model must offer for lookahead decoding, and the attention masks it is given.

Lookahead needs one thing beyond a KV cache: attention that follows a custom 4D mask with
explicit ``position_ids``. Most transformers decoder-only models do, through their public
``attention_mask`` argument. Rather than trusting a list of names, :func:`check_model` probes
the model once (three tokens, no cache of the user's touched) and refuses it with a clear error
when the mask is ignored.

Sliding-window layers need their own mask: key position ``k`` is visible from query position
``q`` only when ``k > q - sliding_window``. Models that mix layer types take a dict of masks
keyed by layer type; models with one type take a single tensor.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ATTENTION = ("eager", "sdpa")


class UnsupportedModelError(ValueError):
    """The model cannot run lookahead decoding exactly; the message says why and what to do."""


@dataclass(frozen=True)
class MaskSpec:
    """Which masks a model's layers need."""

    layer_types: tuple[str, ...]  # distinct types, e.g. ("full_attention", "sliding_attention")
    sliding_window: int | None
    max_positions: int | None  # size of a learned position table, if any bound is known
    keeps_logits: bool = False  # forward() takes logits_to_keep (set by check_model)
    encoder_decoder: bool = False  # lookahead runs in the decoder, over aligned linear steps

    def build(self, step_mask: torch.Tensor, key_pos: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """The ``attention_mask`` argument for one forward pass over a batch.

        step_mask: [L, L] bool, within the step (shared by every row); key_pos: [B, C] position of
        each cached slot, -1 for a hole or pad; positions: [B, L] absolute positions of the step's
        tokens. Returns a float mask [B, 1, L, C + L] (0 = attend, dtype min = blocked), or a
        dict of them keyed by layer type.
        """
        batch, length = positions.shape
        cached = (key_pos >= 0)[:, None, :].expand(batch, length, key_pos.shape[1])
        full = torch.cat([cached, step_mask[None].expand(batch, length, length)], dim=2)  # [B, L, C + L]
        masks = {}
        for layer_type in self.layer_types:
            allowed = full
            if layer_type == "sliding_attention" and self.sliding_window is not None:
                keys = torch.cat([key_pos, positions], dim=1)  # [B, C + L]
                allowed = full & (keys[:, None, :] > positions[:, :, None] - self.sliding_window)
            masks[layer_type] = _to_float(allowed, dtype)
        return masks[self.layer_types[0]] if len(masks) == 1 else masks


def _to_float(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked)[:, None]


def mask_spec(config) -> MaskSpec:
    """Read the attention layout from a (text) config."""
    text = config.get_text_config(decoder=True)
    sliding = getattr(text, "sliding_window", None)
    declared = getattr(text, "layer_types", None)
    if declared:
        types = tuple(dict.fromkeys(declared))
    else:
        types = ("sliding_attention",) if sliding else ("full_attention",)
    unknown = [t for t in types if t not in SUPPORTED_LAYER_TYPES]
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported by lookahead decoding "
            f"(supported: {', '.join(SUPPORTED_LAYER_TYPES)})"
        )
    if "sliding_attention" in types and not sliding:
        types = tuple(dict.fromkeys("full_attention" for _ in types))
    max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return MaskSpec(layer_types=types, sliding_window=sliding, max_positions=max_positions)


_checked: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, MaskSpec]] = weakref.WeakKeyDictionary()


def check_model(model) -> MaskSpec:
    """Refuse models that lookahead cannot run exactly; return their mask layout.

    Checked once per model and attention implementation.
    """
    config = model.config
    attn = getattr(config, "_attn_implementation", None) or "eager"
    cached = _checked.get(model)
    if cached is not None and cached[0] == attn:
        return cached[1]
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        # no custom mask or position_ids reach the decoder (see lookahead.runner): nothing to probe
        spec = dataclasses.replace(mask_spec(config), encoder_decoder=True, layer_types=("full_attention",))
        _checked[model] = (attn, spec)
        return spec
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} is a recurrent / state-space model: its state cannot be rolled back per token "
            "and it takes no token-level attention mask, so lookahead decoding cannot run on it."
        )
    if attn not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"{name} uses attn_implementation={attn!r}, which ignores custom 4D attention masks. "
            "Load it with attn_implementation='sdpa' or 'eager'."
        )
    spec = dataclasses.replace(mask_spec(config), keeps_logits=model._supports_logits_to_keep())
    _probe_mask(model, spec)
    _checked[model] = (attn, spec)
    return spec


@torch.no_grad()
def _probe_mask(model, spec: MaskSpec) -> None:
    """Feed [a, b, c] where c may see only itself, and compare c's logits with c fed alone.

    A model that honours the mask gives (nearly) the same logits; one that ignores it gives the
    logits of c after a and b.
    """
    name = type(model).__name__
    device = model.device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=device)
    dtype = next(model.parameters()).dtype
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool, device=device)
    positions = torch.tensor([0, 1, 0], device=device)
    try:
        cache = DynamicCache()
        masked = (
            model(
                input_ids=ids,
                position_ids=positions[None],
                attention_mask=spec.build(mask, positions.new_zeros(1, 0), positions[None], dtype),
                cache=cache,
                use_cache=True,
            )
            .logits[0, 2]
            .float()
        )
        causal = model(input_ids=ids, use_cache=False).logits[0, 2].float()
        alone = model(input_ids=ids[:, 2:], use_cache=False).logits[0, 0].float()
    except Exception as err:  # the model's own error says what it lacks
        raise UnsupportedModelError(
            f"{name} cannot run a forward pass with explicit position_ids, a custom 4D attention "
            f"mask and a DynamicCache ({type(err).__name__}: {err})"
        ) from err
    if cache.get_seq_length() != 3:
        raise UnsupportedModelError(f"{name} does not fill a KV cache; lookahead decoding needs one.")
    err_masked = (masked - alone).abs().max().item()
    err_causal = (causal - alone).abs().max().item()
    scale = alone.abs().max().item() + 1e-6
    if err_masked > max(0.1 * err_causal, 1e-4 * scale):
        raise UnsupportedModelError(
            f"{name} ignores custom 4D attention masks (masked logits differ from the expected ones "
            f"by {err_masked:.3g}), so lookahead decoding would not be exact on it."
        )
