"""An OpenAI-compatible HTTP server over :class:`lookahead.service.Service` (``lookahead serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``, ``GET /metrics``
(Prometheus). Responses are the ``openai`` package's own types; ``usage`` is in every response,
and the extension field ``lookahead`` says how many forward passes the request took part in, its
tokens per forward pass and the W/N/G it ran with (in a stream: on the chunk that carries the
finish reason, and on the usage chunk). Errors use OpenAI's shape, ``{"error": {"message",
"type", "param", "code"}}``, unknown routes, oversized bodies and internal failures included; an
internal failure's own text is logged, never sent.

A vision-language model served with its processor takes images in chat messages, as OpenAI's
``image_url`` parts holding data URLs (``lookahead.api``, ``lookahead.images``), up to
``max_images`` a request of ``max_image_pixels`` each.

The event loop only moves bytes: a body is read up to ``max_body_bytes`` (413 past it), then
decoded, checked and tokenized (its images decoded and processed) on a worker thread.
``/health`` answers 503 once the engine thread has died or stalled (:meth:`Service.health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from openai.types import Model
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import responses
from .api import ApiError, ImageInputs, ParsedRequest, SamplingDefaults, decode_body, parse_request
from .images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES
from .media import takes_images
from .metrics import Metrics
from .service import QueueFullError, Service, ShuttingDownError
from .service import Request as GenRequest
from .text import TextDecoder

MAX_BODY_BYTES = 4 * 1024 * 1024  # OpenAI-sized prompts fit many times over; 40 MB took 32 s to parse
POOL_SCOPES = ("shared", "key")

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    model_name: str
    api_keys: tuple[str, ...] = ()  # bearer keys that /v1/* accepts; none: no key needed
    # "key": each API key reads and feeds a warm pool of its own (the service must have pool_scopes)
    pool_scope: str = "shared"
    default_max_tokens: int = 512
    # what a request that leaves out temperature / top_p / top_k samples with; None: the model's
    # generation_config where it sets them, OpenAI's defaults where not (SamplingDefaults() alone)
    sampling: SamplingDefaults | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    drain_timeout: float | None = None  # at shutdown, seconds the engine finishes requests in flight
    max_images: int = DEFAULT_MAX_IMAGES  # per chat request, on a vision-language model
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # per image, checked before it is decoded

    def __post_init__(self) -> None:
        self.api_keys = tuple(self.api_keys)
        if any(not key.strip() for key in self.api_keys):
            raise ValueError("an API key is empty: an empty bearer token would be let in; give keys, or none")
        if self.pool_scope not in POOL_SCOPES:
            raise ValueError(f"pool_scope must be one of {POOL_SCOPES}, got {self.pool_scope!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_images < 1 or self.max_image_pixels < 1:
            raise ValueError(f"max_images and max_image_pixels must be at least 1, got {self.max_images} "
                             f"and {self.max_image_pixels}")  # fmt: skip


def create_app(service: Service, tokenizer, settings: ServerSettings, metrics: Metrics, processor=None) -> FastAPI:
    """The FastAPI application; ``service`` runs the engine (its thread is stopped on shutdown).
    ``processor``: a vision-language model's (``lookahead.models.load_processor``), with which its
    chat requests may carry images; None: requests with images are refused."""
    routes = _Routes(service, tokenizer, settings, metrics, processor)
    app = FastAPI(title="lookahead", lifespan=routes.lifespan)
    app.state.sampling_defaults = routes.sampling
    app.add_exception_handler(ApiError, routes.api_error)
    app.add_exception_handler(HTTPException, routes.http_error)
    app.add_middleware(_InternalErrors, metrics=metrics)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", routes.retrieve_model, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return app


class _Routes:
    """The server's state and its route handlers."""

    def __init__(self, service: Service, tokenizer, settings: ServerSettings, metrics: Metrics, processor=None) -> None:
        if settings.pool_scope == "key" and not getattr(service, "pool_scopes", False):
            raise ValueError("pool_scope 'key' needs a Service(..., pool_scopes=True)")
        self.service, self.tokenizer, self.settings, self.metrics = service, tokenizer, settings, metrics
        self.max_positions = service.spec.context_limit  # the position table, or a RoPE threshold (see ModelTraits)
        self.sampling = settings.sampling or _model_sampling_defaults(service.model)
        logger.debug("a request that leaves out a sampling field gets %s", self.sampling.describe())
        # ids a client may send: known to the tokenizer and to the model's embedding table
        self.vocab_size = min(len(tokenizer), service.model.get_input_embeddings().num_embeddings)
        self.max_token_chars = _max_token_chars(tokenizer)
        self.key_digests = [_digest(key) for key in settings.api_keys]
        self.images = None  # what reads a request's images; None: the model takes none
        if processor is not None and takes_images(service.model):
            self.images = ImageInputs(processor, settings.max_images, settings.max_image_pixels)
        elif processor is not None:
            logger.warning("a processor was given, but %s reads no images: requests with images are refused",
                           type(service.model).__name__)  # fmt: skip
        self.served = Model(id=settings.model_name, created=0, object="model", owned_by="lookahead")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        # uvicorn has waited for the requests in flight (up to its graceful shutdown timeout)
        await asyncio.to_thread(self.service.shutdown, self.settings.drain_timeout)

    async def api_error(self, request, err: ApiError):
        self.metrics.errors.labels(str(err.status)).inc()
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def http_error(self, request, err: HTTPException):  # an unknown route, a wrong method: OpenAI's shape too
        codes = {404: "not_found", 405: "method_not_allowed"}
        where = f"{request.method} {request.url.path}"
        error = ApiError(err.status_code, f"{where}: {err.detail}", codes.get(err.status_code))
        return await self.api_error(request, error)

    def authorize(self, request: Request) -> str | None:
        """Check the bearer key; return the request's pool scope (None: the one shared pool)."""
        if not self.key_digests:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given, match = _digest(key.strip()), None
        for index, digest in enumerate(self.key_digests):  # every key, in constant time each
            if hmac.compare_digest(given, digest) and match is None:
                match = index
        # the scheme is case-insensitive (RFC 9110)
        if scheme.lower() != "bearer" or match is None:
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", "invalid_api_key")
        return f"key-{match}" if self.settings.pool_scope == "key" else None  # an index, never the key

    async def health(self):
        state = self.service.health()
        if not state["ok"]:
            raise ApiError(503, f"the engine is not running: {state['reason']}", "engine_unhealthy")
        return {
            "status": "ok",
            "active": state["active"],
            "queued": state["queued"],
            "pool_entries": state["pool_entries"],
        }

    async def prometheus(self):
        self.metrics.active.set(self.service.active)
        self.metrics.queued.set(self.service.queue_depth)
        return PlainTextResponse(self.metrics.render(), media_type=self.metrics.content_type)

    async def list_models(self, request: Request):
        self.authorize(request)
        return {"object": "list", "data": [self.served.model_dump()]}

    async def retrieve_model(self, model: str, request: Request):
        self.authorize(request)
        if model != self.settings.model_name:
            raise ApiError(404, f"the model '{model}' does not exist: this server serves "
                           f"'{self.settings.model_name}'", "model_not_found", "model")  # fmt: skip
        return self.served.model_dump()

    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool):
        scope = self.authorize(request)
        raw = await self.read_body(request)
        parsed = await asyncio.to_thread(self.parse, raw, chat)  # JSON, chat template, tokenizer: CPU work
        gen = GenRequest(
            prompt_ids=parsed.prompt_ids, max_tokens=parsed.max_tokens, temperature=parsed.temperature,
            top_p=parsed.top_p, top_k=parsed.top_k, seed=parsed.seed, lookahead=parsed.lookahead, pool_scope=scope,
            media=parsed.media,
        )  # fmt: skip
        try:
            self.service.submit(gen)
        except QueueFullError as err:
            raise ApiError(429, f"the server is busy ({err}): retry later", "rate_limit_exceeded") from err
        except ShuttingDownError as err:
            raise ApiError(503, str(err), "server_shutting_down") from err
        self.metrics.requests.labels("chat" if chat else "completions").inc()
        exchange = _Exchange(self.service, gen, TextDecoder(self.tokenizer, parsed.stop), request)
        reply = responses.Reply(self.service, exchange, chat, self.settings.model_name)
        if parsed.stream:
            return responses.CancellingStream(
                _stream(exchange, reply, parsed.include_usage, self.metrics), exchange.cancel
            )
        try:
            reason = await exchange.collect()
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        finally:
            exchange.cancel()  # frees the sequence if this task was cancelled (a no-op once it ended)
        return JSONResponse(reply.whole(reason))

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past ``max_body_bytes``: at once when Content-Length says
        so, else (a chunked body) as soon as it grows past the limit."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{int(declared)} bytes", limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(f"over {limit} bytes", limit)
        return bytes(body)

    def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """Decode and check a body, tokenizing its prompt and processing its images (on a worker thread)."""
        body = decode_body(raw)
        try:
            return parse_request(
                body, chat, self.settings.model_name, self.tokenizer, self.max_positions,
                self.settings.default_max_tokens, self.vocab_size, self.sampling, max_token_chars=self.max_token_chars,
                images=self.images,
            )  # fmt: skip
        except RecursionError as err:  # a value nested hundreds deep, compared with a neutral one
            raise ApiError(400, "the body nests arrays or objects too deeply: flatten it") from err


class _InternalErrors:
    """ASGI middleware: an exception that a route lets through is logged with its traceback, and
    the client gets a 500 in OpenAI's shape whose message holds none of its text (an exception
    may carry a CUDA error, a path, a line of the traceback)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # the client has gone: nobody to answer
            return
        except Exception:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            self.metrics.errors.labels("500").inc()
            if not started:  # else the response is under way: its connection just ends
                await JSONResponse(responses.INTERNAL_ERROR.body(), status_code=500)(scope, receive, send)


class ClientGone(Exception):
    """The client closed its connection."""


class _Exchange:
    """One generation request as the server follows it: the engine's request, the text decoded
    so far, whether it has ended, and the client's connection."""

    POLL = 0.25  # seconds between checks that a waiting client is still connected

    def __init__(self, service: Service, gen: GenRequest, decoder: TextDecoder, http: Request) -> None:
        self.service, self.gen, self.decoder, self.http = service, gen, decoder, http
        self.id = uuid.uuid4().hex
        self.ended = False  # finished, failed, or stopped on a stop string: nothing left to cancel

    def cancel(self) -> None:
        """Free the request's sequence at the next step boundary, unless it has ended."""
        if not self.ended:
            self.ended = True
            self.service.cancel(self.gen)

    async def next(self) -> tuple[str, str | None]:
        """The next piece of text and, at the end, the finish reason. A client that went away is
        noticed within ``POLL`` seconds, even while its request waits in the queue."""
        event = await self._event()
        if event.finish_reason and event.finish_reason.startswith("error"):
            self.ended = True
            raise _failure(event.finish_reason, self.id)
        piece = self.decoder.push(event.tokens)
        reason = event.finish_reason
        if self.decoder.stopped:  # a stop string
            if reason is None:  # the sequence leaves the batch; its text up to the stop feeds the pool
                self.service.stop(self.gen, self.decoder.tokens_used)
            reason = "stop"
        if reason:
            self.ended = True
            piece += self.decoder.flush()
        return piece, reason

    async def _event(self):
        gen = self.gen
        while True:
            now = time.monotonic()
            if now - gen.checked_at >= self.POLL:  # also while events keep coming: a busy request is checked too
                gen.checked_at = now
                if await self.http.is_disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(gen.events.get(), self.POLL)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11 on
                continue

    async def collect(self) -> str:
        while True:
            _, reason = await self.next()
            if reason:
                return reason


async def _stream(exchange: _Exchange, reply: responses.Reply, include_usage: bool, metrics: Metrics):
    """Server-sent events: one chunk per step that produced text, the finish reason (with the
    ``lookahead`` field), then (with ``stream_options.include_usage``) a usage chunk, then
    ``data: [DONE]``. An error after the response started is an event of OpenAI's shape."""
    if reply.chat:
        yield reply.chunk("", None, first=True)
    while True:
        try:
            piece, reason = await exchange.next()
        except ClientGone:
            return
        except Exception as err:  # noqa: BLE001 - the client gets OpenAI's shape, never the text
            if not isinstance(err, ApiError):
                logger.exception("streaming request %s failed", exchange.id)
                err = responses.INTERNAL_ERROR
            metrics.errors.labels(str(err.status)).inc()
            yield responses.event(err.body())
            break
        if piece or reason:
            yield reply.chunk(piece, reason)
        if reason:
            if include_usage:
                yield reply.usage_chunk()
            break
    yield "data: [DONE]\n\n"


def _failure(finish_reason: str, request_id: str) -> ApiError:
    """The error a client gets for an engine's failure event: its text stays in the log."""
    if finish_reason.startswith("error: the server shut down"):
        return ApiError(503, "the server shut down before the request finished: send it again",
                        "server_shutting_down")  # fmt: skip
    logger.error("request %s failed in the engine (%s)", request_id, finish_reason)
    return responses.INTERNAL_ERROR


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the body has {size}, past this server's limit of {limit} bytes: send a shorter "
                    "prompt (the limit is lookahead serve's --max-body-bytes)", "request_too_large")  # fmt: skip


def _digest(key: str) -> bytes:
    """Keys are compared as digests: of one length whatever the key's, so the time says nothing."""
    return hashlib.sha256(key.encode()).digest()


def _model_sampling_defaults(model) -> SamplingDefaults:
    sampling, skipped = SamplingDefaults.from_generation_config(model.generation_config)
    if skipped:
        logger.warning("the model's generation_config sets %s, out of a request's range: not used as a default",
                       ", ".join(skipped))  # fmt: skip
    return sampling


def _max_token_chars(tokenizer) -> int | None:
    """The most characters one token covers, where the vocabulary bounds it: a BPE that never
    emits an unknown token and does not normalize the text (byte-level BPE, as GPT-2's, Llama 3's,
    Qwen's); None for other tokenizers (a normalizer may drop characters, an unknown token cover
    a whole word)."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not isinstance(backend.model, BPE):
        return None
    if backend.model.unk_token is not None and not backend.model.byte_fallback:
        return None
    return max(len(token) for token in tokenizer.get_vocab())
