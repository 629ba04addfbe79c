"""The OpenAI request bodies the server accepts, checked field by field.

What is not implemented is refused by name (400), never silently ignored: ``n`` > 1, ``logprobs``,
``tools``, penalties, ``logit_bias``, ``echo``, ``suffix``, ``best_of``, ``response_format``...,
and so are ``max_tokens`` and ``max_completion_tokens`` together (as OpenAI refuses them).
Extensions: ``top_k``, and ``lookahead: {window_size, ngram_size, max_candidates}`` (each capped
by the server's own setting; one left out is the server's).

A chat message's content may hold ``image_url`` parts for a vision-language model served with its
processor (:class:`ImageInputs`): data URLs only (``lookahead.images``), in user messages, at most
``max_images`` a request. The prompt is then the processor's chat template over the messages, and
the request carries the processor's output (``ParsedRequest.media``).

A request that leaves out ``temperature``, ``top_p`` or ``top_k`` gets the server's
:class:`SamplingDefaults`: by default those of the model's own ``generation_config`` where it sets
them (as vLLM and SGLang do), else OpenAI's (temperature 1, no top-p or top-k cut).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, ImageError, decode_data_url

# fields that change nothing about the output, accepted as OpenAI accepts them
_HARMLESS = {"user", "metadata", "store", "service_tier"}
# fields whose neutral value is accepted, anything else refused
_NEUTRAL = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),  # chat's flag; see _NEUTRAL_COMPLETIONS for the completions' count
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
}
# on /v1/completions ``logprobs`` is a count, and 0 still asks for the chosen tokens' logprobs
_NEUTRAL_COMPLETIONS = {**_NEUTRAL, "logprobs": (None,)}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "lookahead"}  # fmt: skip
_FIELDS = {False: _COMMON | {"prompt"}, True: _COMMON | {"messages", "max_completion_tokens"}}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_TEMPERATURE = 1e-5  # below it a request is greedy (the limit of sampling as temperature falls)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1000  # each push looks for every stop string in the unsent text
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit integer, as OpenAI's and vLLM's seeds are
MAX_DIGITS = 100  # a longer integer in a body is out of every field's range: it is not converted


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        # OpenAI answers a wrong key and an unknown model as invalid requests (its codes tell them apart)
        kinds = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}
        self.kind = kind or kinds.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _HugeInt(int):
    """An integer of more than ``MAX_DIGITS`` digits, kept as a number past every field's range
    (Python refuses to convert one of over 4,300 digits, and converting is quadratic)."""

    def __new__(cls, digits: str):
        value = super().__new__(cls, -(10**MAX_DIGITS) if digits.startswith("-") else 10**MAX_DIGITS)
        value.digits = len(digits.lstrip("-"))
        return value

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer"

    __str__ = __repr__


def _parse_int(digits: str) -> int:
    return int(digits) if len(digits) <= MAX_DIGITS else _HugeInt(digits)


def decode_body(raw: bytes):
    """The JSON value of a request body; :class:`ApiError` (400) when it is not JSON."""
    try:
        return json.loads(raw, parse_int=_parse_int)
    except RecursionError as err:
        raise ApiError(400, "the body nests arrays or objects too deeply to decode: flatten it") from err
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {err}") from err


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves out ``temperature``, ``top_p`` or ``top_k`` samples with;
    the bare instance is OpenAI's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    @classmethod
    def from_generation_config(cls, config) -> tuple[SamplingDefaults, list[str]]:
        """The defaults a model's ``generation_config`` sets (OpenAI's for the fields it leaves
        unset), and a note for each value it sets that a request could not ask for, which is
        left out: the server logs those. ``do_sample`` is not read: on this API a request is
        greedy by ``temperature: 0``."""
        found, skipped = {}, []
        for name, valid in (
            ("temperature", lambda v: 0 <= v <= 2),
            ("top_p", lambda v: 0 <= v <= 1),
            ("top_k", lambda v: float(v).is_integer() and v >= 0),
        ):
            value = getattr(config, name, None)
            if value is None:
                continue
            number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
            if not number or not valid(value):
                skipped.append(f"{name}={value!r}")
                continue
            found[name] = value
        for name in ("temperature", "top_p"):  # a config may hold 1 for 1.0; transformers' warpers take floats
            if name in found:
                found[name] = float(found[name])
        if "top_k" in found:
            found["top_k"] = int(found["top_k"]) or None  # 0: no cut, as a request's top_k 0
        if "temperature" in found and found["temperature"] < MIN_TEMPERATURE:
            found["temperature"] = 0.0
        return cls(**found), skipped

    def describe(self) -> str:
        parts = [f"temperature={self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        return ", ".join(parts)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    lookahead: tuple[int | None, int | None, int | None] | None  # a setting left out is None
    media: dict | None = None  # a VLM's processor output for a request with images (tensors, batch 1)


@dataclass(frozen=True)
class ImageInputs:
    """What a server that takes images reads them with: the model's processor, and its limits."""

    processor: object
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # per image, read from its header before it is decoded


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_value", param)


def _int(body: dict, name: str, low: int | None = None, default=None, high: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {value!r}")
    if low is not None and value < low:
        raise _bad(name, f"'{name}' must be at least {low}, got {value}")
    if high is not None and value > high:
        raise _bad(name, f"'{name}' must be at most {high}, got {value}")
    return value


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"'{name}' must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"'{name}' must be between {low} and {high}, got {value}")
    return float(value)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    neutral = _NEUTRAL if chat else _NEUTRAL_COMPLETIONS
    for name, value in body.items():
        if name in _HARMLESS or name in _FIELDS[chat]:
            continue
        if name in neutral:
            if value not in neutral[name]:
                raise ApiError(400, f"'{name}' is not supported by this server (got {value!r})", "unsupported", name)
            continue
        raise ApiError(400, f"unsupported parameter '{name}'", "unsupported_parameter", name)


def _prompt_ids(
    body: dict, chat: bool, tokenizer, vocab_size: int, images: ImageInputs | None
) -> tuple[list[int], str, dict | None]:
    """The prompt's token ids, the field that holds it, and the processor's output where it has images."""
    if not chat:
        return *_completion_ids(body, tokenizer, vocab_size), None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    if images is not None and getattr(images.processor, "chat_template", None) is not None:
        ids, media = _vlm_chat_ids(messages, tokenizer, images)
        return ids, "messages", media
    if tokenizer.chat_template is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "no_chat_template", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]", "each message needs a 'role' string and a 'content'")
        clean.append({"role": message["role"], "content": _content(message.get("content"), i, images is not None)})
    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own check (roles must alternate, ...)
        raise _bad("messages", f"the model's chat template refused these messages: {err}") from err
    return tokenizer(text, add_special_tokens=False)["input_ids"], "messages", None


def _completion_ids(body: dict, tokenizer, vocab_size: int) -> tuple[list[int], str]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"] if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(t < 0 or t >= vocab_size for t in ids):
            raise _bad("prompt", f"token ids must be in [0, {vocab_size})")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "several prompts in one request are not supported: send one request each",
                       "unsupported", "prompt")  # fmt: skip
    else:
        raise _bad("prompt", "'prompt' must be a non-empty string or a list of token ids")
    if not ids:
        raise _bad("prompt", "the prompt is empty: give at least one token")
    return ids, "prompt"


def _content(content, i: int, vlm: bool = False) -> str:
    """A message's text: a string, or a list of text parts joined. ``vlm``: the model reads images,
    but its processor has no chat template to place them with."""
    if isinstance(content, list):  # content parts: text only
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                raise _no_images(f"messages[{i}].content[{j}]", vlm)
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}].text", "a text part needs a 'text' string")
        return "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "'content' must be a string or a list of text parts")
    return content


def _no_images(param: str, vlm: bool) -> ApiError:
    if vlm:
        return ApiError(400, "this model's processor has no chat template, so the server cannot place images in "
                        "its prompt: send text only", "no_chat_template", param)  # fmt: skip
    return ApiError(400, "this model takes no images: send text only (a vision-language model served with its "
                    "processor takes image_url parts)", "unsupported", param)  # fmt: skip


_IMAGE_DETAILS = ("auto", "low", "high", "original")  # OpenAI's; read and ignored


def _vlm_chat_ids(messages: list, tokenizer, images: ImageInputs) -> tuple[list[int], dict | None]:
    """A VLM's chat: the processor's chat template over the messages (each image part as
    ``{"type": "image"}``), then the processor over that text and the decoded images -> (ids, its
    output), as ``processor.apply_chat_template(..., tokenize=True)`` would give; text only, the
    tokenizer's ids and no output."""
    clean, urls = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]", "each message needs a 'role' string and a 'content'")
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = _parts(message, i, urls, images.max_images)
        clean.append({"role": message["role"], "content": parts})
    pictures = [_image(url, param, images.max_pixels) for url, param in urls]
    processor = images.processor
    try:
        text = processor.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # the template's own check (roles must alternate, ...)
        raise _bad("messages", f"the model's chat template refused these messages: {err}") from err
    bos = tokenizer.bos_token
    special = not (bos is not None and text.startswith(bos))  # the processor's rule: bos once
    if not pictures:
        return tokenizer(text, add_special_tokens=special)["input_ids"], None
    try:
        inputs = processor(images=[pictures], text=[text], add_special_tokens=special, return_tensors="pt")
    except Exception as err:  # an image the image processor cannot take, placeholders that do not match...
        raise _bad("messages", f"the model's processor refused these images: {err}") from err
    return inputs["input_ids"][0].tolist(), dict(inputs)


def _parts(message: dict, i: int, urls: list[tuple[str, str]], max_images: int) -> list[dict]:
    """A message's content parts as the processor's template takes them; each image's URL and its
    field are appended to ``urls``, which may hold ``max_images``."""
    content = message.get("content")
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content", "'content' must be a string or a list of text and image_url parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}].text", "a text part needs a 'text' string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if message["role"] != "user":
                raise _bad(f"messages[{i}].content[{j}]", "images go in messages of role 'user' only")
            if len(urls) == max_images:
                raise ApiError(400, f"a request may carry at most {max_images} images: this is one more",
                               "too_many_images", f"messages[{i}].content[{j}]")  # fmt: skip
            urls.append(_image_url(part.get("image_url"), f"messages[{i}].content[{j}].image_url"))
            parts.append({"type": "image"})
        else:
            raise _bad(f"messages[{i}].content[{j}]", "only text and image_url content parts are supported")
    return parts


def _image_url(value, param: str) -> tuple[str, str]:
    """An image part's URL and its field: ``{"url": ..., "detail": ...}`` as OpenAI takes it (or
    the URL string alone)."""
    if isinstance(value, str):
        return value, param
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise _bad(param, "'image_url' must be an object {url, detail}, its url a data URL of the image")
    detail = value.get("detail")
    if detail is not None and detail not in _IMAGE_DETAILS:
        raise _bad(f"{param}.detail", f"'detail' must be one of {', '.join(_IMAGE_DETAILS)}")
    return value["url"], f"{param}.url"


def _image(url: str, param: str, max_pixels: int):
    try:
        return decode_data_url(url, max_pixels)
    except ImageError as err:
        raise _bad(param, str(err)) from err


def _check_placeholders(ids: list[int], media: dict | None, images: ImageInputs | None, param: str) -> None:
    """Refuse a prompt without images whose text holds the model's image token: the model would
    look for an image there."""
    token = getattr(images.processor, "image_token_id", None) if images is not None else None
    if media is None and token is not None and token in ids:
        name = getattr(images.processor, "image_token", token)
        raise _bad(param, f"the prompt holds the model's image token ({name}) but no image: send images as "
                   "image_url parts of a chat message")  # fmt: skip


def _text_length(body: dict, chat: bool) -> tuple[int, str]:
    """How many characters the prompt's text has (chat: its messages' contents), before tokenizing."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        return (len(prompt) if isinstance(prompt, str) else 0), "prompt"
    messages = body.get("messages")
    total = 0
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
    return total, "messages"


def _check_length_bound(body: dict, chat: bool, max_positions: int | None, max_token_chars: int | None) -> None:
    """Refuse, before tokenizing, a prompt too long for the context whatever its tokens: no token
    covers more than ``max_token_chars`` characters."""
    if max_positions is None or not max_token_chars:
        return
    chars, param = _text_length(body, chat)
    at_least = -(-chars // max_token_chars)
    if at_least >= max_positions:
        raise ApiError(400, f"the prompt has {chars} characters, so at least {at_least} tokens, but the model's "
                       f"context is {max_positions}: shorten it", "context_length_exceeded", param)  # fmt: skip


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise _bad("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
                   f"each of at most {MAX_STOP_CHARS} characters")  # fmt: skip
    return stop


def _lookahead(body: dict) -> tuple[int | None, int | None, int | None] | None:
    value = body.get("lookahead")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("lookahead", "'lookahead' must be an object {window_size, ngram_size, max_candidates}")
    unknown = set(value) - {"window_size", "ngram_size", "max_candidates"}
    if unknown:
        raise _bad("lookahead", f"unknown lookahead setting(s) {sorted(unknown)}")
    # one left out (None) is the server's own setting
    return _int(value, "window_size", 0), _int(value, "ngram_size", 2), _int(value, "max_candidates", 0)


def parse_request(
    body,
    chat: bool,
    model_name: str,
    tokenizer,
    max_positions: int | None,
    default_max_tokens: int,
    vocab_size: int,
    defaults: SamplingDefaults = SamplingDefaults(),
    *,
    max_token_chars: int | None = None,
    images: ImageInputs | None = None,
) -> ParsedRequest:
    """Check a request body; raises :class:`ApiError` naming the field at fault. A sampling field
    left out takes its value from ``defaults``. ``max_token_chars``: the most characters one token
    of ``tokenizer`` covers, if known; a prompt that cannot fit the context is then refused before
    it is tokenized. ``images``: the model reads images, with this processor (None: it takes none)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_value")
    _check_model(body, model_name)
    _refuse_unsupported(body, chat)
    stop = _stop(body)
    _check_length_bound(body, chat, max_positions, max_token_chars)
    ids, prompt_param, media = _prompt_ids(body, chat, tokenizer, vocab_size, images)
    _check_placeholders(ids, media, images, prompt_param)
    max_tokens = _max_tokens(body, chat, len(ids), max_positions, default_max_tokens, prompt_param)
    stream, include_usage = _streaming(body)
    top_k = _int(body, "top_k", 0, defaults.top_k)
    temperature = _number(body, "temperature", 0.0, 2.0, defaults.temperature)
    if temperature < MIN_TEMPERATURE:  # logits divided by 1e-45 overflow: its limit, greedy, instead
        temperature = 0.0
    return ParsedRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=_number(body, "top_p", 0.0, 1.0, defaults.top_p),  # 0 keeps the likeliest token alone, as OpenAI's
        top_k=top_k or None,
        seed=_int(body, "seed", SEED_RANGE[0], high=SEED_RANGE[1]),
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        lookahead=_lookahead(body),
        media=media,
    )


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "'model' must be a string")
    if model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{model_name}'",
                       "model_not_found", "model")  # fmt: skip


def _max_tokens(
    body: dict, chat: bool, prompt_tokens: int, max_positions: int | None, default_max_tokens: int, prompt_param: str
) -> int:
    """The tokens to generate: ``max_tokens`` (or, for chat, ``max_completion_tokens``), by default
    what the API's default and the context leave room for; refused where the prompt fills the
    context, or the two together overrun it."""
    room = None if max_positions is None else max_positions - prompt_tokens
    if room is not None and room < 1:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens but the model's context is {max_positions}: "
                       "shorten it", "context_length_exceeded", prompt_param)  # fmt: skip
    if chat and body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ApiError(400, "'max_tokens' and 'max_completion_tokens' were both given: send one of them "
                       "('max_tokens' is the older name)", "invalid_parameter_combination", "max_tokens")  # fmt: skip
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if not chat else default_max_tokens
    if room is not None:
        default = min(default, room)
    max_tokens = _int(body, name, 1, default)
    if room is not None and max_tokens > room:
        message = (
            f"the prompt ({prompt_tokens} tokens) plus {name}={max_tokens} exceeds the model's context "
            f"of {max_positions} tokens: ask for at most {room}"
        )
        raise ApiError(400, message, "context_length_exceeded", name)
    return max_tokens


def _streaming(body: dict) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``)."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", "'stream_options' takes {include_usage: bool}, and only with stream: true")
    return stream, bool((options or {}).get("include_usage"))
