"""The HTTP layer of `lookahead serve` under hostile or unlucky clients: a real uvicorn on a free
port of 127.0.0.1, in this process (so that faults can be injected into its engine and tokenizer),
serving a tiny random-weight llama with a character tokenizer.

Every error is JSON in OpenAI's shape and counted; internal failures reach the client as a
generic 500 and the log with their text; bodies past the limit get 413; parsing runs off the
event loop; /health follows the engine; a stream whose client left before it started is cancelled;
with several API keys each key has its own warm pool.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from threaded_uvicorn import ThreadedUvicorn
from tiny_models import char_tokenizer, repetitive_prompt, tiny_model

from lookahead.config import LookaheadConfig
from lookahead.metrics import Metrics
from lookahead.pool import SharedPool
from lookahead.server import ServerSettings, create_app
from lookahead.service import Service

MODEL = "tiny"
SECRET = "CUDA out of memory. Tried to allocate 20.00 GiB (/srv/weights/secret.bin)"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}assistant:"


class FaultyTokenizer:
    """The tiny models' character tokenizer with a chat template; a prompt holding "BOOM" raises
    an internal error, and one holding "SLOW" takes ``SLOW`` seconds to tokenize."""

    SLOW = 2.0

    def __init__(self) -> None:
        self.inner = copy.deepcopy(char_tokenizer())  # the shared one stays as built
        self.inner.chat_template = TEMPLATE

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __call__(self, text, **kwargs):
        if "BOOM" in text:
            raise RuntimeError(SECRET)
        if "SLOW" in text:
            time.sleep(self.SLOW)
        return self.inner(text, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """A uvicorn server on a thread of this process, over its own Service."""

    def __init__(self, keys=(), pool_scope: str = "shared", max_body_bytes: int = 256 * 1024, pool=True) -> None:
        self.metrics = Metrics()
        self.service = Service(
            tiny_model("llama"), LookaheadConfig(0, 4, 4), max_batch_size=4, max_queue=8,
            shared_pool=SharedPool() if pool else None, pool_scopes=pool_scope == "key", on_step=self.metrics.on_step,
        )  # fmt: skip
        settings = ServerSettings(
            model_name=MODEL, api_keys=keys, pool_scope=pool_scope, max_body_bytes=max_body_bytes, drain_timeout=5
        )
        app = create_app(self.service, FaultyTokenizer(), settings, self.metrics)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = ThreadedUvicorn(app, self.port)
        self.server = self.uvicorn.server

    def errors(self, status: int) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf'^lookahead_request_errors_total{{status="{status}"}} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    def idle(self, seconds: float) -> bool:
        """Whether no sequence is active and none queued, three reads in a row, within ``seconds``."""
        deadline, quiet = time.monotonic() + seconds, 0
        while time.monotonic() < deadline and quiet < 3:
            quiet = quiet + 1 if self.service.active == self.service.queue_depth == 0 else 0
            time.sleep(0.1)
        return quiet >= 3

    def stop(self) -> None:
        self.uvicorn.stop()


@pytest.fixture(scope="module")
def local():
    server = LocalServer()
    yield server
    server.stop()


def post(server: LocalServer, body=None, path="/v1/completions", raw=None, **kwargs) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


PROMPT = {"model": MODEL, "prompt": "abcabc", "max_tokens": 2}


def test_bad_bodies_get_400s_in_openai_s_shape_and_are_counted(local):
    """Bodies that made the server answer 500 in plain text (RecursionError, ValueError, TypeError),
    and stop strings past the caps."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    before = local.errors(400)
    cases = [
        (post(local, raw=b"[" * 100_000), None),
        (post(local, raw=b'{"model": "tiny", "prompt": "ab", "seed": 1' + b"0" * 5000 + b"}"), "seed"),
        (post(local, {**PROMPT, "seed": 2**64}), "seed"),
        (post(local, chat, path="/v1/chat/completions"), "messages[0].content[0].text"),
        (post(local, {**PROMPT, "stop": ["x"] * 17}), "stop"),
        (post(local, {**PROMPT, "stop": "y" * 1001}), "stop"),
    ]
    for response, param in cases:
        error = openai_error(response, 400, param)
        assert "Traceback" not in error["message"]
    assert "16" in cases[4][0].json()["error"]["message"] and "1000" in cases[5][0].json()["error"]["message"]
    assert local.errors(400) - before == len(cases)
    # at the caps: accepted
    assert post(local, {**PROMPT, "stop": ["q" * 1000] * 16}).status_code == 200


def test_an_internal_failure_is_a_generic_500_and_its_text_is_logged(local, caplog):
    before = local.errors(500)
    with caplog.at_level(logging.ERROR):
        response = post(local, {**PROMPT, "prompt": "abBOOM"})
    error = openai_error(response, 500)
    assert error["type"] == "server_error" and "CUDA" not in response.text and "secret" not in response.text
    assert SECRET in caplog.text
    assert local.errors(500) - before == 1


def test_an_engine_failure_reaches_the_client_without_its_text(local, monkeypatch, caplog):
    """The engine's step raises (out of memory): every request in flight fails; the client, streamed
    or not, gets a generic error of OpenAI's shape, and the log has the engine's text."""

    def failing():
        raise RuntimeError(SECRET)

    monkeypatch.setattr(local.service.engine, "step", failing)
    body = {**PROMPT, "prompt": repetitive_prompt(24, 0)[0].tolist(), "max_tokens": 8}
    with caplog.at_level(logging.ERROR):
        whole = post(local, body)
        streamed = post(local, {**body, "stream": True})
    assert "CUDA" not in whole.text and "CUDA" not in streamed.text
    assert openai_error(whole, 500)["type"] == "server_error"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    assert SECRET in caplog.text


def test_bodies_past_the_limit_get_413_before_they_are_read(local):
    """256 KiB is this server's limit: a 4 MB body is refused by its Content-Length, a chunked one
    (no Content-Length) as soon as it passes the limit."""
    big = json.dumps({**PROMPT, "prompt": "a" * 4_000_000}).encode()
    before = local.errors(413)
    declared = post(local, raw=big)
    chunked = post(local, raw=(big[i : i + 16384] for i in range(0, len(big), 16384)))
    for response in (declared, chunked):
        assert openai_error(response, 413)["code"] == "request_too_large"
    assert "262144" in declared.json()["error"]["message"]
    assert local.errors(413) - before == 2
    # a Content-Length past the limit is answered before any of the body is sent
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40000000\r\n\r\n{"
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    under = post(local, {**PROMPT, "prompt": "a" * 200_000, "n": 2})  # under the limit: read and checked
    assert openai_error(under, 400, "n")


def test_tokenizing_runs_off_the_event_loop(local):
    """While a prompt takes 2 s to tokenize, /health answers at once."""
    slow = threading.Thread(target=post, args=(local, {**PROMPT, "prompt": "abSLOW"}))
    slow.start()
    try:
        time.sleep(0.5)  # the slow request is being tokenized
        start = time.monotonic()
        assert httpx.get(f"{local.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - start < FaultyTokenizer.SLOW / 2
    finally:
        slow.join(30)


def test_a_stream_whose_client_left_before_it_started_is_cancelled(local):
    """An ASGI 2.4 server raises OSError from ``send`` once the client has gone (h11 uvicorn drops
    the message instead): the response's start fails, so Starlette never starts the body's
    generator and a ``finally`` in it never runs. The request must still be cancelled, not
    generate 300 tokens for nobody. Driven at the ASGI interface, on the event loop that the
    service reports to, which stays open while the test watches the engine."""
    app = local.server.config.loaded_app
    body = json.dumps({**PROMPT, "prompt": repetitive_prompt(24, 0)[0].tolist(), "max_tokens": 300, "stream": True})
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", local.port),
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body.encode(), "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            raise OSError("the client has gone")

    async def run() -> bool:
        await app(scope, receive, send)
        assert local.metrics.requests.labels("completions")._value.get() >= 1  # it was submitted
        deadline, quiet = time.monotonic() + 5, 0
        while time.monotonic() < deadline and quiet < 3:
            quiet = quiet + 1 if local.service.active == local.service.queue_depth == 0 else 0
            await asyncio.sleep(0.1)
        return quiet >= 3

    tokens_before = local.service.stats.new_tokens
    assert asyncio.run(run())
    assert local.service.stats.new_tokens - tokens_before < 100


def test_health_is_503_once_the_engine_has_stopped():
    server = LocalServer()
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
        server.service.shutdown(timeout=5)  # the engine thread ends; the HTTP server does not
        error = openai_error(httpx.get(f"{server.url}/health", timeout=10), 503)
        assert error["type"] == "server_error" and "engine" in error["message"]
    finally:
        server.stop()


def test_each_api_key_has_its_own_warm_pool():
    """Two keys, pools scoped per key: a request's forward passes do not show what the other key's
    requests left in the pool (each streamed chunk is one step, so they would); the same key's
    own second request is faster. With one shared pool the second key's request is fast too."""
    prompt = repetitive_prompt(24, 3)[0].tolist()

    def passes(server, key: str) -> int:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
        out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        return out.model_extra["lookahead"]["forward_passes"]

    for scope in ("key", "shared"):
        server = LocalServer(keys=("key-a", "key-b"), pool_scope=scope)
        try:
            cold = passes(server, "key-a")
            time.sleep(0.5)  # the finished text goes into the pool over a few engine iterations
            warm = passes(server, "key-a")
            time.sleep(0.5)
            other = passes(server, "key-b")
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-c", max_retries=0).models.list()
        finally:
            server.stop()
        assert warm < cold
        assert other == cold if scope == "key" else other == warm


def test_a_stop_string_ends_the_request_through_service_stop_and_usage_agrees(monkeypatch):
    """The text ends on a stop string: the service hears ``stop(request, tokens used)`` (so that
    the text up to the stop feeds the warm pool), and tokens_per_step counts the tokens of
    ``usage``, not those of the stop's step past the cut. No warm pool: both runs step alike."""
    local = LocalServer(pool=False)
    try:
        prompt = repetitive_prompt(24, 0)[0].tolist()
        body = {**PROMPT, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        steps = [c["choices"][0]["text"] for c in _chunks(post(local, {**body, "stream": True})) if c["choices"]]
        at = next(i for i, piece in enumerate(steps) if len(piece) >= 2 and i > 0)  # a step of several tokens
        text_before = "".join(steps[:at])
        stop = text_before[-3:] + steps[at][0]  # ends on the first token of a step that brought more
        assert stop not in text_before
        calls = []
        stop_request = local.service.stop
        monkeypatch.setattr(local.service, "stop", lambda gen, n: (calls.append(n), stop_request(gen, n)))
        out = post(local, {**body, "stop": stop}).json()
    finally:
        local.stop()
    assert out["choices"][0]["text"] == text_before[:-3] and out["choices"][0]["finish_reason"] == "stop"
    used, info = out["usage"]["completion_tokens"], out["lookahead"]
    assert calls == [used] and used == len(text_before) + 1
    assert info["tokens_per_step"] == round(used / info["forward_passes"], 4)


def _chunks(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    from lookahead.api import ApiError, parse_request

    class Untouchable:
        chat_template = "..."

        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized")

        apply_chat_template = __call__

    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 400}]}]}
    for body, is_chat, param in (({"model": "m", "prompt": "x" * 400}, False, "prompt"), (chat, True, "messages")):
        with pytest.raises(ApiError) as info:
            parse_request(body, is_chat, "m", Untouchable(), 100, 16, 96, max_token_chars=4)
        assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", param)
        assert "400 characters" in info.value.message


def test_api_keys_come_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    from lookahead.cli import build_parser
    from lookahead.cli_serve import api_keys

    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nkey-b\n\n  key-c  \nkey-a\n")

    def parse(*argv):
        return api_keys(build_parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("LOOKAHEAD_API_KEYS", raising=False)
    assert parse() == []
    assert parse("--api-key", "key-a", "--api-key", "key-z", "--api-key-file", str(keys)) == [
        "key-a", "key-z", "key-b", "key-c"
    ]  # fmt: skip
    monkeypatch.setenv("LOOKAHEAD_API_KEYS", "key-e, key-f,")
    assert parse() == ["key-e", "key-f"]
    monkeypatch.setenv("LOOKAHEAD_API_KEYS", " , ")
    with pytest.raises(ValueError, match="LOOKAHEAD_API_KEYS"):
        parse()
    monkeypatch.delenv("LOOKAHEAD_API_KEYS")
    keys.write_text("# none\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        parse("--api-key-file", str(keys))
    with pytest.raises(ValueError, match="empty"):
        parse("--api-key", " ")


def test_max_tokens_and_streaming_fields_are_checked_against_the_context():
    from lookahead.api import ApiError, parse_request

    class ThreeTokens:  # any chat is three tokens long
        chat_template = "..."

        def apply_chat_template(self, messages, **kwargs):
            return "chat"

        def __call__(self, text, **kwargs):
            return {"input_ids": [1, 2, 3]}

    def parse(body, chat=False):
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1, 2, 3]}
        return parse_request({"model": "m", **prompt, **body}, chat, "m", ThreeTokens(), 10, 16, 96)

    def refused(body, chat=False):
        with pytest.raises(ApiError) as info:
            parse(body, chat)
        return info.value.status, info.value.code, info.value.param, info.value.message

    assert parse({}).max_tokens == 7  # OpenAI's default of 16, cut to the 10 - 3 positions left
    assert parse({"max_tokens": 7}).max_tokens == 7
    status, code, param, message = refused({"max_tokens": 8})
    assert (status, code, param) == (400, "context_length_exceeded", "max_tokens") and "at most 7" in message
    assert refused({"prompt": list(range(10))})[:3] == (400, "context_length_exceeded", "prompt")
    assert parse({"max_completion_tokens": 5}, chat=True).max_tokens == 5
    status, code, param, _ = refused({"max_completion_tokens": 8}, chat=True)
    assert (code, param) == ("context_length_exceeded", "max_completion_tokens")
    both = {"max_tokens": 2, "max_completion_tokens": 3}
    assert refused(both, chat=True)[1:3] == ("invalid_parameter_combination", "max_tokens")
    assert (parse({"stream": True}).stream, parse({"stream": True}).include_usage) == (True, False)
    assert parse({"stream": True, "stream_options": {"include_usage": True}}).include_usage is True
    assert refused({"stream": "yes"})[2] == "stream"
    assert refused({"stream_options": {"include_usage": True}})[2] == "stream_options"  # without stream
    assert refused({"stream": True, "stream_options": {"other": 1}})[2] == "stream_options"
