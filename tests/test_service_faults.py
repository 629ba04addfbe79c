"""The server's engine thread under long prompts, faults and shutdown (lookahead.service):
chunked prefill keeps running streams at their pace, a fault at any stage of admission fails the
request at fault alone, warm pools are fed a bounded amount per step, health reflects the engine
thread, and a drain that times out fails what is left. Tiny random-weight models, fp32; every
text is compared with plain ``model.generate``. Bounds are on counts (tokens, steps), not time.
"""

import asyncio
import math

import pytest
import torch
from tiny_models import repetitive_prompt, tiny_model

from lookahead import LookaheadConfig
from lookahead import runner as runner_module
from lookahead.engine import Engine
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
        monkeypatch.setattr(DecoderRunner, "prefill", lambda self, prompts: (
            fail() if any(len(p) == doomed for p in prompts) else prefill(self, prompts)))  # fmt: skip
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
