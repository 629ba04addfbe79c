"""The caller's cache: what ``generate`` was asked to cache with, honoured or refused by name.

A lookahead step keeps its own ``DynamicCache``, which it crops and rearranges token by token
(``lookahead.runner``). So a ``cache_implementation`` it would silently replace is refused (a
quantized cache decodes another text; an offloaded one would save no memory; a static one would
go unused), and an empty ``DynamicCache`` the caller passed is filled at the end, as plain
``generate`` fills it (:func:`caller_cache`, :func:`fill_cache`).
"""

from __future__ import annotations

import logging

from transformers import DynamicCache

from .support import ModelTraits

logger = logging.getLogger(__name__)


# why a lookahead step cannot honour each cache_implementation: it keeps its own DynamicCache,
# which it crops and rearranges token by token (lookahead.runner)
_CACHES_REFUSED = {
    "quantized": "a quantized cache gives other text than the full-precision one lookahead decodes with",
    "offloaded": "its cache stays on the device, so the memory an offloaded cache saves would not be saved",
    "static": "a static cache (and its max_cache_len, for torch.compile) would not be used",
    None: "the cache it asks for would not be used",
}
_STATIC_CACHES = ("static", "sliding_window", "hybrid", "hybrid_chunked")


def check_cache_implementation(generation_config, model) -> None:
    """Refuse a ``cache_implementation`` that lookahead's own DynamicCache would silently replace.
    A static cache that the model's own generation_config asks for (the caller did not choose it)
    gives the same text, so it runs, with a warning."""
    chosen = generation_config.cache_implementation
    if chosen in (None, "dynamic"):
        return
    kind = "offloaded" if "offloaded" in chosen else "static" if chosen in _STATIC_CACHES else None
    kind = "quantized" if chosen == "quantized" else kind
    default = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if kind == "static" and chosen == default:
        logger.warning(
            "the model's generation_config asks for cache_implementation=%r; lookahead decoding keeps its own "
            "DynamicCache instead (the same text)",
            chosen,
        )
        return
    raise ValueError(
        f"lookahead decoding cannot use cache_implementation={chosen!r}: its steps keep their own DynamicCache, "
        f"so {_CACHES_REFUSED[kind]}. Drop cache_implementation (or pass 'dynamic'), or use plain generate for it"
    )


def caller_cache(model_kwargs, batch: int, spec: ModelTraits) -> DynamicCache | None:
    """The empty DynamicCache the caller passed to generate, which lookahead fills at the end as
    plain generate does (:func:`fill_cache`); None when generate made the cache itself. A cache
    that cannot be filled exactly is refused by name."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        return None
    held = cache.get_seq_length()
    if held > 0:  # e.g. the cache of an earlier turn of a chat
        raise ValueError(
            f"lookahead decoding starts from an empty cache, and this one holds {held} tokens: it cannot continue "
            "from them exactly (its prefill would recompute them). Pass a new DynamicCache() or none, or use plain "
            "generate to continue from a filled cache"
        )
    if not getattr(cache, "_is_user_defined", False):  # generate's own (it marks the caller's)
        return None
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        kind = "an offloading DynamicCache" if type(cache) is DynamicCache else f"a {type(cache).__name__}"
        raise ValueError(
            f"lookahead decoding keeps its own DynamicCache and fills a caller's DynamicCache at the end, not "
            f"{kind}: pass DynamicCache() (with config=model.config for sliding windows) or none, or use plain "
            "generate with it"
        )
    if spec.encoder_decoder or batch > 1:
        raise ValueError(
            "lookahead decoding fills a cache passed in for one sequence of a decoder-only model only (a batch's "
            "cache holds holes where its sequences advanced unevenly): generate without cache=, or one sequence "
            "at a time"
        )
    return cache


def fill_cache(target: DynamicCache, source: DynamicCache) -> DynamicCache:
    """Hand what ``source`` holds (one sequence, no holes) to the caller's ``target`` through its own
    ``update``: its layers keep what they would have kept under plain generate (a sliding-window
    layer of ``DynamicCache(config=...)`` its window; a plain layer every column)."""
    for index, layer in enumerate(source.layers):
        if layer.is_initialized:  # layers that share another's keys and values hold none
            target.update(layer.keys, layer.values, index)
    return target
