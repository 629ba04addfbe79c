"""Quantized weights: the schemes ``lookahead.models.load`` builds by name, a loaded model's scheme
in words, and whether its quantized layers keep each token's output its own.

Lookahead's steps feed the model more tokens per forward pass than plain decoding does (the
window, the candidates) and keep them apart with a 4D attention mask. Attention is not the only
place where the tokens of one pass meet: a layer that quantizes its input with one scale for the
whole pass (per-tensor dynamic activation quantization), or that sends a column through higher
precision when any token has an outlier there (bitsandbytes' LLM.int8() with its default
threshold), gives a token another output when the other tokens of the pass change. Such a model's
text would depend on the step's shape, so :func:`mixing_problem` finds it (one probe per kind of
quantized layer) and ``support.check_model`` refuses it by name. Weight-only schemes, and
activations scaled per token, keep tokens apart, and lookahead's output is plain ``generate``'s on
the same quantized model: exactly, as in fp32, where the activations stay fp32 (the weight-only
schemes); up to near-ties, as in bf16, where a scheme rounds them (:data:`ROUNDS_ACTIVATIONS`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# name -> what it is; built by quantization_config
SCHEMES = {
    "int8": "torchao int8 weight-only, a scale per output row (Int8WeightOnlyConfig)",
    "int4": "torchao int4 weight-only, groups of 32 (tinygemm's kernel; on CPU PrototypeInt4WeightOnlyConfig)",
    "int8-dynamic": "torchao int8 weights, int8 activations scaled per token (Int8DynamicActivationInt8WeightConfig)",
    "quanto-int8": "optimum-quanto int8 weights",
    "quanto-int4": "optimum-quanto int4 weights",
    "bnb-8bit": "bitsandbytes LLM.int8() without outlier columns (llm_int8_threshold=0)",
    "bnb-4bit": "bitsandbytes 4-bit NF4, computing in the model's dtype",
}
# schemes that round each token's activations (to int8 per token; bitsandbytes' 8-bit kernel to
# fp16 first): the last-bit differences of a wider step's fp32 sums can then move a value across a
# rounding step, and the logits by far more than a bit, so a near-tie can flip as in bf16
# (docs/exactness.md#quantized-weights)
ROUNDS_ACTIVATIONS = frozenset({"int8-dynamic", "bnb-8bit"})
INT4_GROUP = 32  # divides the in-features of the tiny test models (64) and SmolLM2's (576)


def quantization_config(name: str, dtype: torch.dtype, device: str = "cpu"):
    """transformers' quantization config for the scheme ``name`` of :data:`SCHEMES`, for weights
    that compute in ``dtype`` on ``device``."""
    if name not in SCHEMES:
        raise ValueError(f"unknown quantization {name!r}: use one of {', '.join(SCHEMES)}")
    package = {"quanto": "optimum-quanto", "bnb": "bitsandbytes"}.get(name.split("-")[0], "torchao")
    try:
        return _build(name, dtype, device)
    except ImportError as err:
        raise ValueError(
            f"quantization {name!r} needs {package} ({err}): pip install 'lookahead-decoding[quant]'"
        ) from err


def _build(name: str, dtype: torch.dtype, device: str):
    from transformers import BitsAndBytesConfig, QuantoConfig, TorchAoConfig

    if name.startswith("quanto-"):
        import optimum.quanto  # noqa: F401  (transformers' own check only warns)

        return QuantoConfig(weights=name.removeprefix("quanto-"))
    if name == "bnb-8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    if name == "bnb-4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    import torchao.quantization as ao

    if name == "int8":
        return TorchAoConfig(ao.Int8WeightOnlyConfig())
    if name == "int8-dynamic":
        return TorchAoConfig(ao.Int8DynamicActivationInt8WeightConfig())
    if str(device).startswith("cpu"):  # torchao 0.18 keeps its CPU int4 layout in the prototype
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP))
    return TorchAoConfig(ao.Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d"))


def scheme(model) -> str | None:
    """The model's quantization in words ("torchao Int8WeightOnlyConfig(granularity=PerRow)",
    "bitsandbytes 8-bit (LLM.int8(), outlier threshold 6.0)"), from its config, else from its
    weights' tensor classes (quantized after loading); None for plain weights."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        kinds = sorted({type(module.weight).__name__ for module in _quantized_layers(model)})
        return f"{', '.join(kinds)} weights" if kinds else None
    if isinstance(config, dict):
        method = config.get("quant_method", "unknown")
        return f"{getattr(method, 'value', method)} {config.get('bits', '')}".strip()
    method = getattr(config.quant_method, "value", config.quant_method)
    return f"{method} {_details(config)}".strip()


def _details(config) -> str:
    """The settings that tell one scheme of a quantization method from another."""
    quant_type = getattr(config, "quant_type", None)
    if quant_type is not None and not isinstance(quant_type, (str, dict)):  # torchao
        granularity, group = getattr(quant_type, "granularity", None), getattr(quant_type, "group_size", None)
        settings = [f"group_size={group}"] if group is not None else []
        if granularity is not None:
            parts = granularity if isinstance(granularity, (list, tuple)) else [granularity]
            settings.append(f"granularity={', '.join(type(p).__name__ for p in parts)}")
        return f"{type(quant_type).__name__}({', '.join(settings)})"
    if getattr(config, "load_in_8bit", False):
        return f"8-bit (LLM.int8(), outlier threshold {config.llm_int8_threshold})"
    if getattr(config, "load_in_4bit", False):
        return f"4-bit {config.bnb_4bit_quant_type}"
    weights = getattr(config, "weights", None)  # quanto
    if weights:
        activations = getattr(config, "activations", None)
        return f"{weights} weights" + (f", {activations} activations" if activations else "")
    bits = getattr(config, "bits", None)
    return f"{bits}-bit" if bits else ""


def _quantized_layers(model) -> list[torch.nn.Module]:
    """Layers whose weight is stored quantized: a tensor of a class of its quantizer's (torchao's
    Int8Tensor, quanto's WeightQBytesTensor, bitsandbytes' Int8Params, ...)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and type(module.weight) not in plain
        and isinstance(getattr(module, "in_features", None), int)
    ]


@torch.no_grad()
def mixing_problem(model) -> str | None:
    """Why the model's quantized layers cannot run lookahead's steps exactly, naming the scheme;
    None when they can (or the model has none).

    For each kind of quantized layer (its class and its weight's class), one probe: three tokens'
    inputs go through the layer twice, the second time with the first token 50 times louder. A
    layer that keeps tokens apart gives the last token the same output bit for bit (the same
    shapes run the same kernel); one that quantizes or splits by the whole pass does not."""
    seen = set()
    dtype = model.get_input_embeddings().weight.dtype
    for layer in _quantized_layers(model):
        kind = (type(layer), type(layer.weight))
        if kind in seen:
            continue
        seen.add(kind)
        generator = torch.Generator().manual_seed(0)
        quiet = torch.randn(1, 3, layer.in_features, generator=generator).to(layer.weight.device, dtype)
        loud = quiet.clone()
        loud[:, 0] *= 50
        try:
            same = torch.equal(layer(quiet)[:, -1], layer(loud)[:, -1])
        except Exception as err:  # a layer that runs only inside its model: the model's probe runs it there
            logger.debug("%s cannot run alone (%s): its tokens are not probed", type(layer).__name__, err)
            continue
        if not same:
            return (
                f"has {scheme(model)} weights whose {type(layer).__name__} layers make a token's output depend on "
                "the other tokens of the forward pass (activations quantized or split over the whole pass), so "
                f"lookahead's wider steps would change the text. {_instead(model)}"
            )
    return None


def _instead(model) -> str:
    """What to quantize the model with instead, for its quantization method."""
    config = getattr(model.config, "quantization_config", None)
    method = getattr(getattr(config, "quant_method", None), "value", None)
    if method == "bitsandbytes":
        return "Use BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) or load_in_4bit=True."
    if method == "torchao":
        return (
            "Use a weight-only config (Int8WeightOnlyConfig, Int4WeightOnlyConfig) or activations scaled per "
            "token (Int8DynamicActivationInt8WeightConfig's default granularity)."
        )
    return f"Use a weight-only scheme or activations quantized per token (lookahead.models.load: {', '.join(SCHEMES)})."
