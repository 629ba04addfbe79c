"""An OpenAI-compatible HTTP server over :class:`lookahead.service.Service` (``lookahead serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``, ``GET /metrics``
(Prometheus). Responses are the ``openai`` package's own types; ``usage`` is in every response,
and the extension field ``lookahead`` says how many forward passes the request took part in, its
tokens per forward pass and the W/N/G it ran with (in a stream: on the chunk that carries the
finish reason, and on the usage chunk). Errors use OpenAI's shape, ``{"error": {"message",
"type", "param", "code"}}``, unknown routes included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from starlette.exceptions import HTTPException

from .api import ApiError, SamplingDefaults, parse_request
from .metrics import Metrics
from .service import QueueFullError, Service, ShuttingDownError
from .service import Request as GenRequest
from .text import TextDecoder

POLL = 0.25  # seconds between checks that a waiting client is still connected

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    default_max_tokens: int = 512
    # what a request that leaves out temperature / top_p / top_k samples with; None: the model's
    # generation_config where it sets them, OpenAI's defaults where not (SamplingDefaults() alone)
    sampling: SamplingDefaults | None = None


def create_app(service: Service, tokenizer, settings: ServerSettings, metrics: Metrics) -> FastAPI:
    """The FastAPI application; ``service`` runs the engine (its thread is stopped on shutdown)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(service.shutdown)  # uvicorn has waited for requests in flight

    if settings.api_key is not None and not settings.api_key.strip():
        raise ValueError("the API key is empty: an empty bearer token would be let in; give a key, or None")
    app = FastAPI(title="lookahead", lifespan=lifespan)
    max_positions = service.spec.context_limit  # the position table, or a RoPE threshold (see MaskSpec)
    sampling = settings.sampling
    if sampling is None:
        sampling, skipped = SamplingDefaults.from_generation_config(service.model.generation_config)
        if skipped:
            logger.warning("the model's generation_config sets %s, out of a request's range: not used as a default",
                           ", ".join(skipped))  # fmt: skip
    app.state.sampling_defaults = sampling
    logger.debug("a request that leaves out a sampling field gets %s", sampling.describe())
    # ids a client may send: known to the tokenizer and to the model's embedding table
    vocab_size = min(len(tokenizer), service.model.get_input_embeddings().num_embeddings)

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        metrics.errors.labels(str(err.status)).inc()
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):  # an unknown route, a wrong method: OpenAI's shape too
        codes = {404: "not_found", 405: "method_not_allowed"}
        where = f"{request.method} {request.url.path}"
        error = ApiError(err.status_code, f"{where}: {err.detail}", codes.get(err.status_code))
        return await api_error(request, error)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", "invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok", "active": service.active, "queued": service.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        metrics.active.set(service.active)
        metrics.queued.set(service.queue_depth)
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    served = Model(id=settings.model_name, created=0, object="model", owned_by="lookahead")

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [served.model_dump()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request):
        authorize(request)
        if model != settings.model_name:
            raise ApiError(404, f"the model '{model}' does not exist: this server serves '{settings.model_name}'",
                           "model_not_found", "model")  # fmt: skip
        return served.model_dump()

    async def generate(request: Request, chat: bool):
        authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the body is not valid JSON: {err}") from err
        parsed = parse_request(
            body, chat, settings.model_name, tokenizer, max_positions, settings.default_max_tokens, vocab_size, sampling
        )
        gen = GenRequest(
            prompt_ids=parsed.prompt_ids,
            max_tokens=parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            seed=parsed.seed,
            lookahead=parsed.lookahead,
        )
        try:
            service.submit(gen)
        except QueueFullError as err:
            raise ApiError(429, f"the server is busy ({err}): retry later", "rate_limit_exceeded") from err
        except ShuttingDownError as err:
            raise ApiError(503, str(err), "server_shutting_down") from err
        metrics.requests.labels("chat" if chat else "completions").inc()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        decoder = TextDecoder(tokenizer, parsed.stop)
        if parsed.stream:
            return StreamingResponse(
                _stream(service, gen, decoder, request, chat, rid, created, settings.model_name, parsed.include_usage),
                media_type="text/event-stream",
            )
        try:
            reason = await _collect(service, gen, decoder, request)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        finally:
            service.cancel(gen)  # no-op once finished; frees the sequence if this task was cancelled
        usage = _usage(gen, decoder)
        extra = {"lookahead": _lookahead_info(service, gen)}
        if chat:
            message = ChatCompletionMessage(role="assistant", content=decoder.text)
            choice = ChatChoice(index=0, message=message, finish_reason=reason)
            out = ChatCompletion(
                id=rid, object="chat.completion", created=created, model=settings.model_name,
                choices=[choice], usage=usage, **extra,
            )  # fmt: skip
        else:
            choice = CompletionChoice(index=0, text=decoder.text, finish_reason=reason)
            out = Completion(
                id=rid, object="text_completion", created=created, model=settings.model_name,
                choices=[choice], usage=usage, **extra,
            )  # fmt: skip
        return JSONResponse(out.model_dump(exclude_none=True))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class ClientGone(Exception):
    """The client closed its connection."""


async def _next(service: Service, gen: GenRequest, decoder: TextDecoder, http: Request) -> tuple[str, str | None]:
    """The next piece of text and, at the end, the finish reason. A client that went away is
    noticed within ``POLL`` seconds, even while its request waits in the queue."""
    while True:
        now = time.monotonic()
        if now - gen.checked_at >= POLL:  # also while events keep coming: a busy request is checked too
            gen.checked_at = now
            if await http.is_disconnected():
                raise ClientGone
        try:
            event = await asyncio.wait_for(gen.events.get(), POLL)
            break
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11 on
            continue
    if event.finish_reason and event.finish_reason.startswith("error"):
        raise ApiError(500, f"generation failed ({event.finish_reason})", "server_error", kind="server_error")
    piece = decoder.push(event.tokens)
    reason = event.finish_reason
    if decoder.stopped:  # a stop string: the sequence leaves the batch at the next step
        service.cancel(gen)
        reason = "stop"
    if reason:
        piece += decoder.flush()
    return piece, reason


async def _collect(service: Service, gen: GenRequest, decoder: TextDecoder, http: Request) -> str:
    while True:
        _, reason = await _next(service, gen, decoder, http)
        if reason:
            return reason


async def _stream(service, gen, decoder, http, chat, rid, created, model_name, include_usage):
    """Server-sent events: one chunk per step that produced text, the finish reason (with the
    ``lookahead`` field), then (with ``stream_options.include_usage``) a usage chunk, then
    ``data: [DONE]``."""

    def chunk(text: str | None, reason: str | None, first: bool = False, usage=None) -> str:
        if chat:
            delta = ChoiceDelta(role="assistant" if first else None, content=text)
            choices = [] if usage else [ChunkChoice(index=0, delta=delta, finish_reason=reason)]
            out = ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model_name,
                choices=choices, usage=usage,
            )  # fmt: skip
        else:
            # streamed completion chunks carry finish_reason null until the last (as OpenAI's do),
            # which CompletionChoice's type does not admit: built without validation
            piece = CompletionChoice.model_construct(index=0, text=text or "", finish_reason=reason, logprobs=None)
            choices = [] if usage else [piece]
            out = Completion(
                id=rid, object="text_completion", created=created, model=model_name,
                choices=choices, usage=usage,
            )  # fmt: skip
        if usage or reason:
            out = out.model_copy(update={"lookahead": _lookahead_info(service, gen)})
        body = out.model_dump(exclude_none=True)
        for choice in body["choices"]:
            choice.setdefault("finish_reason", None)  # null until the last chunk, as OpenAI sends it
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk("", None, first=True)
        while True:
            try:
                piece, reason = await _next(service, gen, decoder, http)
            except ClientGone:
                return
            except ApiError as err:
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            if piece or reason:
                yield chunk(piece, reason)
            if reason:
                if include_usage:
                    yield chunk(None, None, usage=_usage(gen, decoder))
                break
        yield "data: [DONE]\n\n"
    finally:
        service.cancel(gen)  # a client that went away frees its sequence at the next step


def _usage(gen: GenRequest, decoder: TextDecoder) -> CompletionUsage:
    completion = decoder.tokens_used
    prompt = len(gen.prompt_ids)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _lookahead_info(service: Service, gen: GenRequest) -> dict:
    w, n, g = gen.settings(service.cfg)
    steps = gen.seq.steps if gen.seq is not None else 0
    return {
        "forward_passes": steps,
        "tokens_per_step": round(gen.sent / steps, 4) if steps else 0.0,
        "window_size": w,
        "ngram_size": n,
        "max_candidates": g,
        "plain": service.cfg.max_candidates == 0 and service.cfg.window_size == 0,
    }
