"""The server's engine thread under long prompts, faults and shutdown (lookahead.service):
chunked prefill keeps running streams at their pace, a fault at any stage of admission fails the
request at fault alone, warm pools are fed a bounded amount per step, health reflects the engine
thread, and a drain that times out fails what is left. Tiny random-weight models, fp32; every
text is compared with plain ``model.generate``. Bounds are on counts (tokens, steps), not time.
"""

import asyncio
import math
import threading
import time

import pytest
import torch
from tiny_models import repetitive_prompt, tiny_model

from lookahead import LookaheadConfig
from lookahead import runner as runner_module
from lookahead.engine import Engine
from lookahead.pool import SharedPool
from lookahead.runner import DecoderRunner
from lookahead.service import Request, Service
from lookahead.slab import Slab

CFG = LookaheadConfig(0, 4, 4)


def expected(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def collect(request: Request) -> tuple[list[int], str]:
    tokens, reason = [], None
    while reason is None:
        event = await request.events.get()
        tokens, reason = tokens + event.tokens, event.finish_reason
    return tokens, reason


def record_passes(service: Service, log: list) -> None:
    """Log, on the engine thread, each forward pass ("step" over the running batch, or "prefill"
    with its token count) and each report of new tokens to a request."""
    model, forward = service.model, service.model.forward

    def logged(*args, **kwargs):
        ids = kwargs["input_ids"]
        kind = "step" if kwargs.get("cache") is service.engine.runner.cache else "prefill"
        log.append((kind, ids.numel()))
        return forward(*args, **kwargs)

    model.forward = logged
    report = service._report

    def reported(request):
        before = request.sent
        report(request)
        if request.sent > before:
            log.append(("tokens", id(request)))

    service._report = reported


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_its_pace():
    """A 150-token prompt arrives while another request streams: with a chunk of 16 tokens, no
    more than 16 prompt tokens are prefilled between two of the stream's token reports, the
    stream gets a report every step while the long prompt is prefilled, and both texts are
    generate's (the chunked prefill is exact)."""
    model = tiny_model("llama")
    service = Service(model, CFG, max_batch_size=4, max_queue=4, prefill_chunk=16)
    log: list = []
    record_passes(service, log)
    running, long = repetitive_prompt(12, 0)[0].tolist(), repetitive_prompt(150, 3)[0].tolist()

    async def main():
        first = Request(prompt_ids=running, max_tokens=120)
        service.submit(first)
        head = await first.events.get()
        second = Request(prompt_ids=long, max_tokens=20)
        service.submit(second)
        rest, (tokens, reason) = await asyncio.gather(collect(first), collect(second))
        return (head.tokens + rest[0], rest[1]), (tokens, reason), first

    try:
        (a, a_reason), (b, _), first = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        del model.forward  # the class's again
        service.shutdown(timeout=30)
    assert a == expected(model, running, 120) and a_reason in ("length", "stop")
    assert b == expected(model, long, 20)
    prefills = [n for kind, n in log if kind == "prefill"]
    assert sum(prefills) >= len(long) and max(prefills) <= 16  # the long prompt went in chunks
    gaps, since = [], 0  # prompt tokens prefilled between two reports to the stream
    for kind, what in log:
        if kind == "tokens" and what == id(first):
            gaps.append(since)
            since = 0
        elif kind == "prefill":
            since += what
    assert max(gaps) <= 16
    assert sum(1 for gap in gaps if gap > 0) >= math.ceil(len(long) / 16) - 1  # a report after each chunk


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # a slab's merge, and per-layer tensors (sliding)
@pytest.mark.parametrize("stage", ["prefill", "merge", "first token", "chunk"])
def test_a_fault_at_any_stage_of_admission_fails_only_the_request_at_fault(arch, stage, monkeypatch):
    """Two newcomers arrive together while a request runs; admitting one of them fails (out of
    memory, simulated) in its prefill, in joining the running cache, in choosing its first token,
    or in the second chunk of a long prompt. It alone fails, with an error event; the newcomer
    beside it and the running request give generate's text."""
    model = tiny_model(arch)
    service = Service(model, CFG, max_batch_size=4, max_queue=4, prefill_chunk=48 if stage == "chunk" else 512)
    running = repetitive_prompt(14, 0)[0].tolist()
    doomed = repetitive_prompt(60 if stage == "chunk" else 23, 1)[0].tolist()
    healthy = repetitive_prompt(9, 2)[0].tolist()
    _inject(monkeypatch, stage, len(doomed))

    async def main():
        first = Request(prompt_ids=running, max_tokens=60)
        service.submit(first)
        head = await first.events.get()
        pair = [Request(prompt_ids=p, max_tokens=12) for p in (doomed, healthy)]
        with service._cond:  # both wait in the queue when the engine next plans: one round
            for request in pair:
                service.submit(request)
        results = await asyncio.gather(collect(first), *(collect(r) for r in pair))
        return head.tokens + results[0][0], results[1], results[2]

    try:
        first_tokens, (lost, error), (tokens, _) = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        monkeypatch.undo()
        service.shutdown(timeout=30)
    assert first_tokens == expected(model, running, 60)
    assert lost == [] and error.startswith("error:") and "simulated out of memory" in error
    assert tokens == expected(model, healthy, 12)


def _inject(monkeypatch, stage: str, doomed: int) -> None:
    """Make admitting the prompt of ``doomed`` tokens fail at ``stage``."""

    def fail():
        raise RuntimeError("simulated out of memory")

    if stage == "prefill":
        prefill = DecoderRunner.prefill
        monkeypatch.setattr(DecoderRunner, "prefill", lambda self, prompts, media=None: (
            fail() if any(len(p) == doomed for p in prompts) else prefill(self, prompts, media)))  # fmt: skip
    elif stage == "chunk":  # the first chunk goes in; the next fails
        extend = DecoderRunner.extend
        monkeypatch.setattr(DecoderRunner, "extend", lambda self, tokens: (
            fail() if self.key_pos is not None else extend(self, tokens)))  # fmt: skip
    elif stage == "first token":
        emit = Engine._emit_last
        monkeypatch.setattr(Engine, "_emit_last", lambda self, seqs, logits: (
            fail() if any(len(s.committed) == doomed for s in seqs) else emit(self, seqs, logits)))  # fmt: skip
    else:  # merge: where the slab allocates, or halfway through the layers' tensors
        admit = Slab.admit
        monkeypatch.setattr(Slab, "admit", lambda self, cache: (
            fail() if cache.layers[0].keys.shape[2] == doomed else admit(self, cache)))  # fmt: skip
        pad, calls = runner_module._left_pad, []

        def failing_pad(states, width, value):
            if states.dim() == 4 and states.shape[2] == doomed:  # the newcomers' keys or values
                calls.append(1)
                if len(calls) >= 2:  # a layer's keys went through: fail on its values
                    fail()
            return pad(states, width, value)

        monkeypatch.setattr(runner_module, "_left_pad", failing_pad)


def test_a_finished_text_goes_into_the_warm_pool_a_bounded_number_of_positions_per_step(monkeypatch):
    """A finished request's text is added to the warm pool in pieces of at most POOL_FEED positions,
    one piece per engine step (a 32k-token text took 205 ms at once, stalling every stream), and
    the pool ends exactly as one add_text of the whole text leaves it."""
    model = tiny_model("llama")
    shared = SharedPool()
    service = Service(model, CFG, max_batch_size=2, max_queue=4, shared_pool=shared)
    monkeypatch.setattr(service, "POOL_FEED", 16)
    pieces = []
    add = shared.add_text
    monkeypatch.setattr(shared, "add_text", lambda tokens, start=0, stop=None: (
        pieces.append((start, stop)), add(tokens, start, stop))[1])  # fmt: skip
    prompt = repetitive_prompt(70, 4)[0].tolist()

    async def main():
        request = Request(prompt_ids=prompt, max_tokens=10)
        service.submit(request)
        return await collect(request), request

    try:
        (tokens, _), request = asyncio.run(asyncio.wait_for(main(), 60))
        deadline = time.monotonic() + 30
        while service._feeding and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        service.shutdown(timeout=30)
    text = prompt + tokens
    assert pieces and all(stop - start <= 16 for start, stop in pieces)
    assert [p[0] for p in pieces] == list(range(0, len(text), 16))[: len(pieces)]
    whole = SharedPool()
    whole.add_text(text)
    assert list(shared._lru) == list(whole._lru)


def test_a_request_ended_on_a_stop_string_feeds_the_pool_up_to_the_stop():
    """``Service.stop(request, k)``: the request leaves the batch, and its prompt and first k
    tokens (not the tokens after the stop string) feed the warm pool; a cancelled request's text
    feeds nothing."""
    model = tiny_model("llama")
    shared = SharedPool(max_suffix=1, span=1)
    service = Service(model, LookaheadConfig(0, 2, 0), max_batch_size=2, max_queue=4, shared_pool=shared)
    stopped, cancelled = repetitive_prompt(10, 5)[0].tolist(), repetitive_prompt(10, 6)[0].tolist()

    async def run(prompt, end):
        request = Request(prompt_ids=prompt, max_tokens=200)
        service.submit(request)
        tokens = []
        while len(tokens) < 3:
            tokens += (await request.events.get()).tokens
        end(request)
        return request

    try:
        kept = asyncio.run(run(stopped, lambda r: service.stop(r, 2)))
        gone = asyncio.run(run(cancelled, service.cancel))
        deadline = time.monotonic() + 30
        while (kept.seq.finished is False or gone.seq.finished is False or service._feeding) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
    finally:
        service.shutdown(timeout=30)
    fed = SharedPool(max_suffix=1, span=1)
    fed.add_text(kept.seq.committed[: len(stopped) + 2])
    assert len(kept.seq.committed) > len(stopped) + 2  # tokens past the stop were generated, not fed
    assert list(shared._lru) == list(fed._lru)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread is killed
def test_health_reflects_a_stuck_or_dead_engine_thread(monkeypatch):
    """``Service.health()``: ok while the engine steps; not ok while a step has taken longer than
    stall_seconds with work waiting, nor once the engine thread has died."""
    model = tiny_model("llama")
    service = Service(model, CFG, max_batch_size=2, max_queue=4, stall_seconds=0.3)
    release = threading.Event()
    forward = model.forward

    def stuck(*args, **kwargs):
        release.wait(20)
        return forward(*args, **kwargs)

    async def main():
        assert service.health()["ok"]
        model.forward = stuck
        request = Request(prompt_ids=repetitive_prompt(9, 0)[0].tolist(), max_tokens=4)
        service.submit(request)
        await asyncio.sleep(0.8)
        during = service.health()
        release.set()
        del model.forward
        await collect(request)
        return during, service.health()

    try:
        during, after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        release.set()
        if "forward" in vars(model):
            del model.forward
    assert not during["ok"] and "no engine step" in during["reason"]
    assert after["ok"]
    monkeypatch.setattr(service, "_plan", lambda: 1 / 0)  # the thread's own loop fails: it dies
    reason = asyncio.run(asyncio.wait_for(_ask_once(service), 30))
    service._thread.join(10)
    dead = service.health()
    assert not dead["ok"] and "stopped" in dead["reason"]
    assert reason.startswith("error:")  # the request that found it dying is not left waiting


async def _ask_once(service) -> str:
    request = Request(prompt_ids=[1, 5, 6], max_tokens=2)
    service.submit(request)  # wakes the engine thread
    return (await collect(request))[1]


def test_a_drain_that_times_out_fails_what_is_left_and_stops():
    """``shutdown(timeout)`` waits at most about ``timeout`` for requests in flight (a client that
    stopped reading must not hold the server forever), then each gets a final error event and the
    engine thread stops."""
    model = tiny_model("llama")
    service = Service(model, LookaheadConfig(0, 2, 0), max_batch_size=2, max_queue=4)
    forward = model.forward
    model.forward = lambda *a, **k: (time.sleep(0.02), forward(*a, **k))[1]  # about 50 steps a second
    request = Request(prompt_ids=repetitive_prompt(9, 0)[0].tolist(), max_tokens=100_000)
    events = []

    async def main():
        service.submit(request)
        events.append(await request.events.get())
        began = time.monotonic()
        await asyncio.to_thread(service.shutdown, 0.5)
        took = time.monotonic() - began
        while True:
            event = await asyncio.wait_for(request.events.get(), 10)
            if event.finish_reason:
                return event.finish_reason, took

    try:
        reason, took = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        del model.forward
    assert took < 5 and not service._thread.is_alive()
    assert reason == "error: the server shut down before the request finished"
