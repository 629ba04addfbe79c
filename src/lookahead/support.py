"""What a model must offer for lookahead decoding, and the attention masks it is given.

Lookahead's full step (t, the Jacobi window, a token tree of candidates) needs attention that
follows a custom 4D mask with explicit ``position_ids``. Most transformers decoder-only models
offer both through their public ``attention_mask`` and ``position_ids`` arguments. Rather than
trusting a list of names, :func:`check_model` probes the model once (a few tokens, no cache of
the user's touched): the mask must be honoured, and the positions must matter (a model that
silently drops ``position_ids`` would otherwise give wrong output). Quantized layers are probed
first (``lookahead.quantization.mixing_problem``): one in which the tokens of a forward pass meet
outside attention is refused, naming its scheme.

Models that take no positions (BLOOM and other ALiBi models, which derive them from a 2D padding
mask) still run *linear* steps exactly: t and one candidate chain, causal, is plain decoding of
several tokens. For them the probe checks that a 2D mask with holes gives the logits of the text
without the holes; the loop then runs W=0, G<=1 with 2D masks (``ModelTraits.positions`` False).

Sliding-window layers need their own mask: key position ``k`` is visible from query position
``q`` only when ``k > q - sliding_window``. Models that mix layer types take a dict of masks
keyed by layer type; models with one type take a single tensor.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .quantization import mixing_problem
from .slab import uniform_shape

logger = logging.getLogger(__name__)

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ATTENTION = ("eager", "sdpa")
# layer kinds that carry a recurrent state (transformers 5.25+ names Mamba, GDN and the like
# "linear_attention", short convolutions "conv", mixed layers "hybrid"; "mamba" is the old name)
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")


class UnsupportedModelError(ValueError):
    """The model cannot run lookahead decoding exactly; the message says why and what to do."""


@dataclass(frozen=True)
class ModelTraits:
    """What a model's forward pass can take and needs: its layers' masks, positions, context
    limit, ``logits_to_keep``, encoder-decoder shape (found by :func:`check_model`'s probe)."""

    layer_types: tuple[str, ...]  # distinct types, e.g. ("full_attention", "sliding_attention")
    sliding_window: int | None
    # the context the model states (max_position_embeddings, n_positions), if any: a server holds its
    # requests to it (context_limit), as vLLM's max_model_len does; generate runs past it unless the
    # model has a position table (position_table)
    max_positions: int | None
    keeps_logits: bool = False  # forward() takes logits_to_keep (set by check_model)
    encoder_decoder: bool = False  # lookahead runs in the decoder, over aligned linear steps
    positions: bool = True  # takes position_ids and 4D masks; False: linear steps with 2D masks
    # (layers, heads, head dim, dtype) when the probe's cache held keys and values of one shape
    # [B, heads, C, head dim] and dtype in every layer: a batch's cache can then be one tensor from
    # the prefill on (lookahead.slab.uniform_shape)
    cache_shape: tuple | None = None
    # a position at which the model's rotary embedding changes with the highest position of a
    # forward pass (transformers' "longrope": long factors once it reaches
    # original_max_position_embeddings; "dynamic": frequencies rescaled past max_position_embeddings)
    rope_threshold: int | None = None
    # the position of t at which the model's own generate recomputes the whole cache (Phi-3's
    # ``prepare_inputs_for_generation`` drops it on reaching original_max_position_embeddings, so
    # that every key gets the long factors); the loop then does the same (``Engine._refill``)
    refill_at: int | None = None
    # past rope_threshold the frequencies keep changing with every new highest position ("dynamic"
    # RoPE rescales them for each longer text; longrope's long factors stay fixed once reached)
    rope_dynamic: bool = False
    # rows of the model's position table (GPT-2's wpe, OPT's and BART's learned positions, Marian's
    # sinusoids), past whose end it cannot run; None where positions are computed (rotary, ALiBi,
    # relative biases), which plain generate runs past max_position_embeddings (check_model)
    position_table: int | None = None

    @property
    def context_limit(self) -> int | None:
        """The most tokens a sequence may hold when its steps share forward passes with other
        sequences (a server's batch): the model's stated context, and ``rope_threshold``, past which
        one sequence's positions would change the rotary frequencies of the others'."""
        limits = [x for x in (self.max_positions, self.rope_threshold) if x is not None]
        return min(limits) if limits else None

    def position_limit(self, t_position: int) -> int | None:
        """The highest position a step whose t sits at ``t_position`` may reach, filler slots
        included: within the position table, and below ``rope_threshold`` while t is (a plain
        step's rotary frequencies depend on t's position alone; a wider step must not change them);
        past the threshold of a dynamic RoPE, t's own (every new position rescales them)."""
        if self.rope_threshold is not None and t_position < self.rope_threshold:
            return self.rope_threshold - 1
        if self.rope_dynamic and self.rope_threshold is not None:
            return t_position
        if self.position_table is None:
            return None
        return max(self.position_table - 1, t_position)

    @property
    def linear(self) -> bool:
        """Whether steps must be linear (t and one candidate chain, no window)."""
        return self.encoder_decoder or not self.positions

    def build(
        self, step_mask: torch.Tensor, key_pos: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, trim: int = 0
    ):
        """The ``attention_mask`` argument for one forward pass over a batch.

        step_mask: [L, L], within the step (shared by every sequence): bool, or already additive
        floats of ``dtype`` (``StepLayout.on_device``); key_pos: [B, C] position of each cache
        column, -1 for a hole or pad; positions: [B, L] absolute positions of the step's tokens;
        trim: leading columns that sliding-window layers no longer hold. Returns a float mask
        [B, 1, L, C + L] (0 = attend, dtype min = blocked), or a dict of them keyed by layer type
        (sliding layers' masks then have ``trim`` columns fewer).
        """
        batch, length = positions.shape
        zero, blocked = _fill_values(dtype, key_pos.device)
        if step_mask.dtype == torch.bool:
            step_mask = additive_mask(step_mask, dtype)
        within = step_mask[None, None].expand(batch, 1, length, length)
        masks = {}
        for layer_type in self.layer_types:
            sliding = layer_type == "sliding_attention" and self.sliding_window is not None
            columns = key_pos[:, trim:] if sliding else key_pos
            cached = torch.where(columns >= 0, zero, blocked)[:, None, None, :]  # [B, 1, 1, C]
            mask = torch.cat([cached.expand(batch, 1, length, columns.shape[1]), within], dim=3)  # [B, 1, L, C + L]
            if sliding:  # keys at or before query - window are out of reach
                keys = torch.cat([columns, positions], dim=1)  # [B, C + L]
                reach = keys[:, None, None, :] > positions[:, None, :, None] - self.sliding_window
                mask = mask.masked_fill(~reach, blocked)
            masks[layer_type] = mask
        return masks[self.layer_types[0]] if len(masks) == 1 else masks

    def sliding_layers(self, config) -> tuple[int, ...]:
        """Indices of the decoder layers that attend over a sliding window."""
        if self.sliding_window is None or "sliding_attention" not in self.layer_types:
            return ()
        text = config.get_text_config(decoder=True)
        declared = getattr(text, "layer_types", None) or ["sliding_attention"] * text.num_hidden_layers
        return tuple(i for i, kind in enumerate(declared) if kind == "sliding_attention")


_FILL_VALUES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _fill_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(0, dtype min) as 0-d tensors of ``dtype`` on ``device``, made once."""
    key = (dtype, device)
    if key not in _FILL_VALUES:
        _FILL_VALUES[key] = (
            torch.zeros((), dtype=dtype, device=device),
            torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device),
        )
    return _FILL_VALUES[key]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive floats attention takes: 0 where allowed, dtype min elsewhere."""
    zero, blocked = _fill_values(dtype, allowed.device)
    return torch.where(allowed, zero, blocked)


def mask_spec(config) -> ModelTraits:
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
    threshold, dynamic = _rope_threshold(text)
    return ModelTraits(
        layer_types=types,
        sliding_window=sliding,
        max_positions=max_positions,
        rope_threshold=threshold,
        rope_dynamic=dynamic,
        position_table=max_positions,  # until check_model has looked at the model's modules
    )


def _rope_threshold(text) -> tuple[int | None, bool]:
    """Where the model's rotary frequencies start to depend on a forward pass's highest position
    (see ``ModelTraits.rope_threshold``), or None where they never do; and whether they keep changing
    past it (``ModelTraits.rope_dynamic``)."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None, False
    nested = [p for p in params.values() if isinstance(p, dict)]  # by layer type
    found, dynamic = [], False
    for entry in nested or [params]:
        kind = entry.get("rope_type") or entry.get("type") or ""
        if kind == "longrope":
            original = entry.get("original_max_position_embeddings") or getattr(
                text, "original_max_position_embeddings", None
            )
            found.append(original)
        elif "dynamic" in kind:
            found.append(getattr(text, "max_position_embeddings", None))
            dynamic = True
    found = [x for x in found if x]
    return (min(found), dynamic) if found else (None, False)


def _model_spec(model) -> ModelTraits:
    """The config's layout, with the position table the model's own modules hold (or none)."""
    spec = mask_spec(model.config)
    return dataclasses.replace(spec, position_table=_position_table(model, spec.max_positions))


def _position_table(model, positions: int | None) -> int | None:
    """``positions`` where the model looks positions up in a table of that many rows, past whose end
    it cannot run: an embedding other than the token embeddings with ``positions`` rows, or 2 more
    (OPT and BART offset theirs by 2). None where it has none: rotary embeddings, ALiBi and
    relative biases compute any position, and plain generate runs past max_position_embeddings."""
    if positions is None:
        return None
    tokens = model.get_input_embeddings().weight
    for module in model.modules():
        if (
            isinstance(module, torch.nn.Embedding)
            and module.weight is not tokens
            and positions <= module.num_embeddings <= positions + 2
        ):
            return positions
    return None


_checked: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, torch.dtype], ModelTraits]] = (
    weakref.WeakKeyDictionary()
)


def check_model(model) -> ModelTraits:
    """Refuse models that lookahead cannot run exactly; return their mask layout.

    Checked once per model, attention implementation and dtype: a model cast to another dtype after
    its first call is probed again (exactness and the cache's shape both depend on the dtype).
    """
    config = model.config
    attn = getattr(config, "_attn_implementation", None) or "eager"
    key = (attn, next(model.parameters()).dtype)
    cached = _checked.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    name = type(model).__name__
    mixing = mixing_problem(model)  # quantized layers whose tokens meet outside attention
    if mixing is not None:
        raise UnsupportedModelError(f"{name} {mixing}")
    if getattr(config, "is_encoder_decoder", False):
        # no custom mask or position_ids reach the decoder (see lookahead.runner): nothing to probe
        spec = dataclasses.replace(_model_spec(model), encoder_decoder=True, layer_types=("full_attention",))
        _checked[model] = (key, spec)
        return spec
    declared = getattr(config.get_text_config(decoder=True), "layer_types", None) or ()
    recurrent = sorted({t for t in declared if t in RECURRENT_LAYER_TYPES})
    if getattr(model, "_is_stateful", False) or recurrent:  # the flag before 5.25, the layer types since
        raise UnsupportedModelError(
            f"{name} is a recurrent / state-space model"
            + (f" (its layers include {', '.join(recurrent)})" if recurrent else "")
            + ": its state cannot be rolled back per token "
            "and it takes no token-level attention mask, so lookahead decoding cannot run on it."
        )
    if attn not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"{name} uses attn_implementation={attn!r}, which ignores custom 4D attention masks. "
            "Load it with attn_implementation='sdpa' or 'eager'."
        )
    spec = dataclasses.replace(_model_spec(model), keeps_logits=model._supports_logits_to_keep())
    problem, cache = _probe_full(model, spec)
    if problem is None:
        spec = dataclasses.replace(spec, cache_shape=uniform_shape(cache))
    else:
        linear_problem = _probe_linear(model)
        if linear_problem is not None:
            raise UnsupportedModelError(
                f"{name} {problem}, and {linear_problem}: lookahead decoding cannot run it exactly."
            )
        spec = dataclasses.replace(spec, positions=False)
    if spec.rope_threshold is not None and _drops_cache_at(model, spec.rope_threshold):
        spec = dataclasses.replace(spec, refill_at=spec.rope_threshold)
    _checked[model] = (key, spec)
    return spec


def _drops_cache_at(model, threshold: int) -> bool:
    """Whether the model's ``prepare_inputs_for_generation`` (what plain generate calls before
    every forward pass) drops a cache of ``threshold`` tokens once the text holds one more: then
    plain decoding recomputes every key there. Asked as generate asks, with a stand-in cache whose
    length alone is real. A model whose signature cannot take the question (it needs inputs of its
    own) is taken to keep its cache; one that fails on it is refused: lookahead could not know
    where plain generate recomputes the cache."""
    cache = DynamicCache()
    dummy = torch.zeros(1, 1, threshold, 1, device=model.device)
    cache.update(dummy, dummy, 0)
    ids = torch.zeros(1, threshold + 1, dtype=torch.long, device=model.device)
    question = dict(input_ids=ids, next_sequence_length=1, cache=cache, attention_mask=torch.ones_like(ids))
    prepare = model.prepare_inputs_for_generation
    try:
        inspect.signature(prepare).bind(**question, use_cache=True)
    except TypeError as err:  # a model-specific signature: no answer
        logger.warning(
            "%s.prepare_inputs_for_generation cannot be asked whether it recomputes its cache at position %d (%s): "
            "taken to keep it",
            type(model).__name__,
            threshold,
            err,
        )
        return False
    try:
        inputs = prepare(**question, use_cache=True)
    except Exception as err:
        raise UnsupportedModelError(
            f"{type(model).__name__}.prepare_inputs_for_generation failed when asked whether plain generate "
            f"recomputes the cache at position {threshold} ({type(err).__name__}: {err}), so lookahead decoding "
            "cannot promise its output: use plain generate for this model"
        ) from err
    return inputs.get("cache", inputs.get("past_key_values")) is None


def _ids(model, count: int) -> torch.Tensor:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.tensor([[(3 + 7 * i) % vocab for i in range(count)]], device=model.device)


@torch.no_grad()
def _probe_full(model, spec: ModelTraits) -> tuple[str | None, DynamicCache | None]:
    """Feed [a, b, c] where c may see only itself, and compare c's logits with c fed alone; then
    move c to another position and check that its logits change. None when the model honours
    both the mask and the positions; else what it lacks. With it, the first run's cache."""
    ids, dtype = _ids(model, 3), next(model.parameters()).dtype
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool, device=model.device)
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool, device=model.device))

    def run(step_mask, positions):
        positions = torch.tensor(positions, device=model.device)
        cache = DynamicCache()
        out = model(
            input_ids=ids,
            position_ids=positions[None],
            attention_mask=spec.build(step_mask, positions.new_zeros(1, 0), positions[None], dtype),
            cache=cache,
            use_cache=True,
        )
        return out.logits[0, 2].float(), cache

    try:
        masked, cache = run(mask, [0, 1, 0])
        shifted, _ = run(causal, [0, 1, 7])
        in_place, _ = run(causal, [0, 1, 2])
        alone = model(input_ids=ids[:, 2:], use_cache=False).logits[0, 0].float()
        plain = model(input_ids=ids, use_cache=False).logits[0, 2].float()
    except Exception as err:  # the model's own error says what it lacks
        return f"cannot run a forward pass with explicit position_ids and a custom 4D attention mask ({err})", None
    if cache.get_seq_length() != 3:
        return "does not fill a KV cache", None
    scale = alone.abs().max().item() + 1e-6
    err_masked, err_causal = (masked - alone).abs().max().item(), (plain - alone).abs().max().item()
    if err_masked > max(0.1 * err_causal, 1e-4 * scale):
        return f"ignores custom 4D attention masks (masked logits off by {err_masked:.3g})", None
    if (in_place - plain).abs().max().item() > 1e-3 * scale and not _decodes_alike(model, ids, in_place, scale):
        return "does not follow a custom 4D causal mask as its own", None
    if (shifted - in_place).abs().max().item() <= 1e-5 * scale:
        return "ignores position_ids (moving a token to another position leaves its logits unchanged)", None
    return None, cache


def _decodes_alike(model, ids: torch.Tensor, in_place: torch.Tensor, scale: float) -> bool:
    """Whether ``in_place`` (the last token's logits under a custom causal mask) are what plain
    decoding computes, one token per pass over a cache: the reference for a model whose own mask
    over a whole input is not causal (PaliGemma's prefix attention), which decodes this way."""
    cache = DynamicCache()
    for i in range(ids.shape[1]):
        logits = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits
    return (in_place - logits[0, -1].float()).abs().max().item() <= 1e-3 * scale


@torch.no_grad()
def _probe_linear(model) -> str | None:
    """Linear steps with 2D masks: prefill [a, x, b] with x masked out, then step [c, d]; the
    logits of c and d must be those of [a, b, c, d] without the hole. None when they are."""
    ids = _ids(model, 5)  # a x b c d
    try:
        cache = DynamicCache()
        prefix_mask = torch.tensor([[1, 0, 1]], device=model.device)
        model(input_ids=ids[:, :3], attention_mask=prefix_mask, cache=cache, use_cache=True)
        step_mask = torch.tensor([[1, 0, 1, 1, 1]], device=model.device)
        got = model(input_ids=ids[:, 3:], attention_mask=step_mask, cache=cache, use_cache=True).logits[0].float()
        text = torch.cat([ids[:, :1], ids[:, 2:]], dim=1)  # a b c d
        expected = model(input_ids=text, use_cache=False).logits[0, 2:].float()
    except Exception as err:
        return f"cannot run linear steps with a 2D mask either ({type(err).__name__}: {err})"
    scale = expected.abs().max().item() + 1e-6
    if (got - expected).abs().max().item() > 1e-4 * scale:
        return "does not give exact logits for linear steps over a cache with masked holes either"
    return None
