"""What the server sends back: OpenAI's completion objects and stream chunks (the ``openai``
package's own types), with ``usage`` and the ``lookahead`` extension field."""

from __future__ import annotations

import json
import time

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from starlette.responses import StreamingResponse

from .api import ApiError

# what a client learns of a failure inside the server (the log has the rest)
INTERNAL_ERROR = ApiError(500, "the server failed to handle this request: see its log", "internal_error")


def event(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body)}\n\n"


class CancellingStream(StreamingResponse):
    """A stream of server-sent events that calls ``on_close`` however it ends. Starlette cancels
    a StreamingResponse whose client left before the response started without ever starting the
    body's generator, so a ``finally`` inside the generator would not run."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Reply:
    """The response objects of one request (``exchange``: its engine request and decoder)."""

    def __init__(self, service, exchange, chat: bool, model_name: str) -> None:
        self.service, self.exchange, self.chat, self.model_name = service, exchange, chat, model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + exchange.id
        self.created = int(time.time())

    def whole(self, reason: str) -> dict:
        """The non-streamed response, once the request has finished for ``reason``."""
        text, usage = self.exchange.decoder.text, self.usage()
        common = dict(id=self.id, created=self.created, model=self.model_name, usage=usage, lookahead=self.info())
        if self.chat:
            message = ChatCompletionMessage(role="assistant", content=text)
            choice = ChatChoice(index=0, message=message, finish_reason=reason)
            out = ChatCompletion(object="chat.completion", choices=[choice], **common)
        else:
            choice = CompletionChoice(index=0, text=text, finish_reason=reason)
            out = Completion(object="text_completion", choices=[choice], **common)
        return out.model_dump(exclude_none=True)

    def chunk(self, text: str | None, reason: str | None, first: bool = False) -> str:
        """A stream chunk of text; the one with the finish reason carries the ``lookahead`` field."""
        if self.chat:
            delta = ChoiceDelta(role="assistant" if first else None, content=text)
            choices = [ChunkChoice(index=0, delta=delta, finish_reason=reason)]
        else:
            # streamed completion chunks carry finish_reason null until the last (as OpenAI's do),
            # which CompletionChoice's type does not admit: built without validation
            choices = [CompletionChoice.model_construct(index=0, text=text or "", finish_reason=reason, logprobs=None)]
        return self._chunk(choices, None, with_info=reason is not None)

    def usage_chunk(self) -> str:
        return self._chunk([], self.usage(), with_info=True)

    def _chunk(self, choices: list, usage, with_info: bool) -> str:
        common = dict(id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage)
        if self.chat:
            out = ChatCompletionChunk(object="chat.completion.chunk", **common)
        else:
            out = Completion(object="text_completion", **common)
        if with_info:
            out = out.model_copy(update={"lookahead": self.info()})
        body = out.model_dump(exclude_none=True)
        for choice in body["choices"]:
            choice.setdefault("finish_reason", None)  # null until the last chunk, as OpenAI sends it
        return event(body)

    def usage(self) -> CompletionUsage:
        completion = self.exchange.decoder.tokens_used
        prompt = len(self.exchange.gen.prompt_ids)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def info(self) -> dict:
        """The ``lookahead`` field: forward passes, and tokens per pass counted over the tokens the
        text used (those past a stop string's cut are not in ``usage`` either)."""
        gen, cfg = self.exchange.gen, self.service.cfg
        w, n, g = gen.settings(cfg)
        steps = gen.seq.steps if gen.seq is not None else 0
        used = self.exchange.decoder.tokens_used
        return {
            "forward_passes": steps,
            "tokens_per_step": round(used / steps, 4) if steps else 0.0,
            "window_size": w,
            "ngram_size": n,
            "max_candidates": g,
            "plain": cfg.max_candidates == 0 and cfg.window_size == 0,
        }
