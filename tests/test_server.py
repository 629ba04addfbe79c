"""`lookahead serve` as its users meet it: a real uvicorn process on a free port of 127.0.0.1, the
real `openai` client (sync and async), the bundled SmolLM2 in fp32.

Two servers run for the module: A (shared warm pool, API key, batches of 8) and B (no shared pool,
batches of 2, a queue of 2). Both use fixed W/N/G = (0, 4, 4), so that their step shapes, hence
their tokens per step, do not depend on timing. Marked slow (about two minutes); CI runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from lookahead import models

pytestmark = pytest.mark.slow

KEY = "test-key"
NEW_TOKENS = 24
CODE = [
    "def fibonacci(n):",
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import math\n\n\ndef area_of_circle(radius):",
    "# Sort a list of numbers with bubble sort\ndef bubble_sort(numbers):",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
    "SELECT name, COUNT(*) FROM orders",
    "The capital of France is",
]
PROMPTS = CODE + [p + "\n" for p in CODE]  # 16 prompts of mixed lengths


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, *args: str, model: str = "smollm2") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lookahead.cli", "serve", "--model", model, "--dtype", "float32"]
        cmd += ["--port", str(self.port), "-W", "0", "-N", "4", "-G", "4", *args]
        self.log = tempfile.TemporaryFile(mode="w+")  # read back when the server fails
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start in 180 s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(match.group(1))

    def wait_idle(self, seconds: float = 30) -> bool:
        """Whether no sequence is active and none queued, three reads in a row, within ``seconds``
        (a queued request whose client left may still be admitted once before it is freed)."""
        deadline, quiet = time.time() + seconds, 0
        while time.time() < deadline and quiet < 3:
            idle = self.metric("lookahead_active_sequences") == self.metric("lookahead_queue_depth") == 0
            quiet = quiet + 1 if idle else 0
            time.sleep(0.3)
        return quiet >= 3

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


@pytest.fixture(scope="module")
def smollm2():
    return models.load("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def server_a():
    server = Server("--api-key", KEY, "--max-batch-size", "8")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def server_b():
    server = Server("--no-shared-pool", "--max-batch-size", "2", "--max-queue", "2")
    yield server
    server.stop()


def client(server: Server, key: str = KEY, cls=openai.OpenAI):
    return cls(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def reference(smollm2, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
    model, tokenizer = smollm2
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


async def _complete(server, prompt: str, delay: float, stream: bool, **kwargs) -> str:
    await asyncio.sleep(delay)
    async with client(server, cls=openai.AsyncOpenAI) as api:
        if not stream:
            out = await api.completions.create(model="smollm2", prompt=prompt, **kwargs)
            return out.choices[0].text
        pieces = []
        async for chunk in await api.completions.create(model="smollm2", prompt=prompt, stream=True, **kwargs):
            pieces += [c.text for c in chunk.choices]
        return "".join(pieces)


def test_concurrent_greedy_requests_match_generate_alone(server_a, smollm2):
    """16 requests arriving at different times (so they join a running batch), half of them
    streamed: each text equals model.generate on its prompt alone."""

    async def run():
        jobs = [
            _complete(server_a, p, delay=0.3 * i, stream=i % 2 == 1, max_tokens=NEW_TOKENS, temperature=0)
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*jobs)

    passes_before = server_a.metric("lookahead_forward_passes_total")
    texts = asyncio.run(run())
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert text == reference(smollm2, prompt), prompt
    passes = server_a.metric("lookahead_forward_passes_total") - passes_before
    assert passes < len(PROMPTS) * NEW_TOKENS / 2, "requests were not batched together"


def test_streamed_equals_non_streamed_chat(server_a):
    api = client(server_a)
    messages = [{"role": "user", "content": "List three prime numbers."}]
    whole = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0)
    chunks = list(
        api.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens > 0 and whole.model_extra["lookahead"]["forward_passes"] >= 1
    # the chunk with the finish reason says what the request ran with, usage asked for or not
    bare = list(api.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0,
                                            stream=True))  # fmt: skip
    last = [c for c in bare if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["lookahead"]["forward_passes"] >= 1 and last.model_extra["lookahead"]["ngram_size"] == 4


def test_seeded_sampling_same_alone_and_in_a_busy_batch(server_a):
    api = client(server_a)
    prompt = "Once upon a time"

    def sample(seed: int) -> str:
        out = api.completions.create(
            model="smollm2", prompt=prompt, seed=seed, max_tokens=32, temperature=0.9, top_p=0.95,
            extra_body={"top_k": 50},
        )  # fmt: skip
        return out.choices[0].text

    alone = sample(7)

    async def busy():
        others = [_complete(server_a, p, 0.0, False, max_tokens=40, temperature=0.8) for p in PROMPTS[:6]]
        mine = asyncio.to_thread(sample, 7)
        return (await asyncio.gather(mine, *others))[0]

    assert asyncio.run(busy()) == alone
    assert sample(8) != alone  # another seed, another draw (32 tokens at temperature 0.9)
    # top_p = 0 (accepted, as OpenAI does) keeps the likeliest token alone: greedy's text, any seed
    nucleus = api.completions.create(model="smollm2", prompt=prompt, seed=8, max_tokens=32, temperature=0.9, top_p=0)
    greedy = api.completions.create(model="smollm2", prompt=prompt, max_tokens=32, temperature=0)
    assert nucleus.choices[0].text == greedy.choices[0].text


def test_errors_have_openai_shape(server_a, smollm2):
    url, auth = server_a.url, {"Authorization": f"Bearer {KEY}"}
    _, tokenizer = smollm2
    long_prompt = "hello " * 9000  # past SmolLM2's 8192 positions

    def post(body, path="/v1/completions", headers=auth, raw=None):
        return httpx.post(f"{url}{path}", json=body if raw is None else None, content=raw, headers=headers, timeout=60)

    ok = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (post(None, raw=b"{not json", headers={**auth, "content-type": "application/json"}), 400, None),
        (post({**ok, "max_tokens": "many"}), 400, "max_tokens"),
        (post({**ok, "temperature": 5}), 400, "temperature"),
        (post({**ok, "prompt": long_prompt}), 400, "prompt"),
        (post({**ok, "max_tokens": 9000}), 400, "max_tokens"),
        (post({**ok, "n": 2}), 400, "n"),
        (post({**ok, "logprobs": 3}), 400, "logprobs"),
        (post({**ok, "logprobs": 0}), 400, "logprobs"),  # 0 still asks for the chosen tokens' logprobs
        (post({**chat, "max_tokens": 3, "max_completion_tokens": 6}, path="/v1/chat/completions"), 400, "max_tokens"),
        (post(ok, path="/v1/no-such-route"), 404, None),
        (httpx.get(f"{url}/v1/completions", headers=auth), 405, None),
        (httpx.get(f"{url}/v1/models/gpt-4", headers=auth), 404, "model"),
        (post({**ok, "frobnicate": 1}), 400, "frobnicate"),
        (
            post(
                {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
                path="/v1/chat/completions",
            ),
            400,
            "tools",
        ),  # fmt: skip
        (post({**ok, "lookahead": {"ngram_size": 1}}), 400, "ngram_size"),
        (post({**ok, "model": "gpt-4"}), 404, "model"),
        (post(ok, headers={}), 401, None),
        (post(ok, headers={"Authorization": "Bearer wrong"}), 401, None),
    ]
    for response, status, param in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, error
    with pytest.raises(openai.AuthenticationError):
        client(server_a, key="wrong").models.list()
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server_a).completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client(server_a).completions.create(model="smollm2", prompt="hi", max_tokens=2, n=2)


def test_models_health_metrics(server_a):
    assert [m.id for m in client(server_a).models.list()] == ["smollm2"]
    assert client(server_a).models.retrieve("smollm2").id == "smollm2"
    assert httpx.get(f"{server_a.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server_a.url}/metrics").text
    for name in ("requests_total", "active_sequences", "queue_depth", "generated_tokens_total",
                 "forward_passes_total", "tokens_per_step", "step_seconds_bucket"):  # fmt: skip
        assert f"lookahead_{name}" in text


def test_dropped_streams_free_their_sequences(server_a):
    """8 clients drop their streams after the first chunks: their sequences leave the batch within
    seconds, long before the 2,000 tokens each asked for (were cancelling a no-op, they would run
    for minutes)."""
    new_tokens = 2000
    body = {"model": "smollm2", "prompt": "Count from one to a hundred:", "max_tokens": new_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    before = server_a.metric("lookahead_generated_tokens_total")
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", f"{server_a.url}/v1/completions", json=body, headers=headers) for _ in range(8)]
        lines = []  # kept: a line iterator that is dropped closes its response, so its client is gone at once
        for stream in streams:
            lines.append(stream.__enter__().iter_lines())
            next(lines[-1])  # the first chunk has come
        assert server_a.metric("lookahead_active_sequences") > 0
        for stream in streams:
            stream.__exit__(None, None, None)
    assert server_a.wait_idle(15), server_a.output()
    generated = server_a.metric("lookahead_generated_tokens_total") - before
    assert 8 <= generated < 8 * new_tokens / 4


def test_per_request_lookahead_settings_are_capped_and_honoured(server_a, smollm2):
    api = client(server_a)
    prompt = CODE[1]
    plain = api.completions.create(model="smollm2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                   extra_body={"lookahead": {"max_candidates": 0}})  # fmt: skip
    capped = api.completions.create(model="smollm2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"lookahead": {"max_candidates": 99, "ngram_size": 3}})  # fmt: skip
    info = plain.model_extra["lookahead"]
    assert info["max_candidates"] == 0 and info["forward_passes"] == plain.usage.completion_tokens
    assert capped.model_extra["lookahead"]["max_candidates"] == 4  # the server's G
    assert capped.model_extra["lookahead"]["ngram_size"] == 3
    assert plain.choices[0].text == capped.choices[0].text == reference(smollm2, prompt)


def test_warm_pool_raises_tokens_per_step_not_outputs(server_a, server_b):
    """8 related requests (the same code, different edits asked), one after another: with the
    shared pool, later requests draw candidates from earlier outputs."""
    code = CODE[5] + "        counts[word] = counts.get(word, 0) + 1\n    return counts\n"
    asks = ["Add type hints", "Add a docstring", "Make it case-insensitive", "Ignore punctuation"]
    prompts = [f"{code}\n# {ask} to count_words{'.' * k}\ndef count_words(" for k in range(2) for ask in asks]

    def run(server) -> tuple[list[str], float]:
        api, texts, tokens, passes = client(server), [], 0, 0
        for prompt in prompts:
            out = api.completions.create(model="smollm2", prompt=prompt, max_tokens=32, temperature=0)
            texts.append(out.choices[0].text)
            tokens += out.usage.completion_tokens
            passes += out.model_extra["lookahead"]["forward_passes"]
        return texts, tokens / passes

    shared_texts, shared_rate = run(server_a)
    alone_texts, alone_rate = run(server_b)
    assert shared_texts == alone_texts
    print(f"tokens per forward pass: shared pool {shared_rate:.2f}, without {alone_rate:.2f}")
    assert shared_rate > alone_rate * 1.1


def test_full_queue_gets_429_with_retry_after(server_b):
    """Server B decodes 2 sequences and queues 2 more: a fifth request is refused with 429. (The
    prompt's greedy answer counts on past 400 tokens without an end-of-text, so no slot frees early;
    a prompt whose answer ended, as "Count from one to a hundred:" does after 164, made this flaky.)"""
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        streams = [http.stream("POST", f"{server_b.url}/v1/completions", json=body) for _ in range(4)]
        entered = []
        try:
            for stream in streams:  # a streamed answer's headers come once the request is queued
                entered.append(stream.__enter__())
            deadline = time.time() + 30
            while server_b.metric("lookahead_queue_depth") < 2 and time.time() < deadline:
                time.sleep(0.1)
            assert server_b.metric("lookahead_queue_depth") == 2
            refused = http.post(f"{server_b.url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
        finally:
            for stream in streams[: len(entered)]:
                stream.__exit__(None, None, None)
    assert server_b.wait_idle(), server_b.output()


@contextlib.contextmanager
def _streamed(server: Server, body: dict):
    """A streamed completion's server-sent events, read one at a time."""
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        yield (line[6:] for line in response.iter_lines() if line.startswith("data: "))


def test_sigterm_finishes_requests_in_flight_then_exits_0(smollm2):
    """SIGTERM while a streamed request is being decoded (its first chunks have come, and more come
    after the signal): it still gets all its text, then the server exits 0. (--drain-timeout: a
    loaded machine may take more than the default 30 s for it.)"""
    server = Server("--max-batch-size", "2", "--drain-timeout", "600")
    try:
        body = {"model": "smollm2", "prompt": CODE[0], "max_tokens": 64, "temperature": 0, "stream": True}
        with _streamed(server, body) as events:
            first = [json.loads(next(events)) for _ in range(2)]  # in flight: decoding has begun
            os.kill(server.proc.pid, signal.SIGTERM)
            rest = [json.loads(event) for event in events if event != "[DONE]"]
        chunks = [c for c in first + rest if c["choices"]]
        assert sum(1 for c in rest if c["choices"] and c["choices"][0]["text"]) >= 1  # text came after SIGTERM
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference(smollm2, CODE[0], 64)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()


def test_drain_timeout_cancels_what_is_left_then_exits_0():
    """A request that would take minutes is in flight at SIGTERM: after --drain-timeout 2 the
    server cancels it and exits 0, instead of waiting for it."""
    server = Server("--max-batch-size", "2", "--drain-timeout", "2")
    try:
        body = {"model": "smollm2", "prompt": "Count from one to a thousand:", "max_tokens": 4000, "stream": True}
        with _streamed(server, body) as events:
            next(events)  # decoding has begun
            start = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            assert server.proc.wait(timeout=40) == 0
            assert time.monotonic() - start < 30
    finally:
        server.stop()


def test_a_request_without_sampling_fields_gets_the_model_s_generation_config(tmp_path, smollm2):
    """A checkpoint whose generation_config sets top_k=1: a request that leaves top_k out samples
    from the likeliest token alone, greedy's text whatever its seed, as vLLM serves such a model;
    one that sets top_k itself gets its own."""
    folder = tmp_path / "smollm2-top1"
    folder.mkdir()
    for item in models.resolve("smollm2").iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").unlink()
    config = smollm2[0].generation_config.to_dict() | {"temperature": 0.7, "top_k": 1}
    (folder / "generation_config.json").write_text(json.dumps(config))
    server = Server("--max-batch-size", "2", model=str(folder))
    try:
        api = client(server)

        def complete(**extra) -> str:
            out = api.completions.create(model=str(folder), prompt="Once upon a time", max_tokens=24, **extra)
            return out.choices[0].text

        greedy = reference(smollm2, "Once upon a time", 24)
        assert [complete(seed=seed) for seed in (1, 2, 3)] == [greedy] * 3  # top_k=1: greedy's text, any seed
        own = [complete(seed=seed, temperature=1.5, extra_body={"top_k": 0}) for seed in (1, 2, 3)]
        assert any(text != greedy for text in own)  # the request's own top_k (no cut) samples
        assert "gets temperature=0.7, top_k=1 (the model's generation_config" in server.output()
    finally:
        assert server.stop() == 0
