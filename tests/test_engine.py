"""The step-level engine as a server drives it: sequences join a running batch at step
boundaries and leave when done; seeded sampling; the warm pool; streaming text with stop strings.
Tiny random-weight models, fp32; the real server is tested in test_server.py.
"""

import asyncio
import collections
import copy
import gc
import math
import weakref

import pytest
import torch
from tiny_models import CONFIGS, repetitive_prompt, tiny_model, tiny_seq2seq
from transformers import (
    EosTokenCriteria,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from lookahead import LookaheadConfig, LookaheadStats
from lookahead.assembly import make_chooser, new_sequence
from lookahead.costs import CostCurve
from lookahead.drafting import TreeDrafter
from lookahead.emission import Emitter
from lookahead.engine import Engine
from lookahead.layout import build_layout
from lookahead.pool import SharedPool
from lookahead.service import Request, Service
from lookahead.support import check_model
from lookahead.text import TextDecoder
from lookahead.verify import position_noise

NEW = 30


def run_engine(model, cfg, prompts, arrivals, *, seeds=None, temperature=None, shared=None, drafter=None,
               on_engine=None, curve=None):  # fmt: skip
    """Admit prompt i at step ``arrivals[i]`` of a running engine -> (texts, stats); ``on_engine``
    sees the engine before its first step; ``curve``: the chooser's cost curve (else the model's,
    timed once per cache: a test that needs given choices gives it)."""
    spec = check_model(model)
    stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.max_emitted)
    chooser = make_chooser(model, cfg, spec, 1, curve)
    engine = Engine(model, cfg, spec, chooser, Emitter(), stats, drafter=drafter)
    if on_engine is not None:
        on_engine(engine)
    seqs, step = {}, 0
    while len(seqs) < len(prompts) or engine.active:
        due = [i for i, at in enumerate(arrivals) if at == step and i not in seqs]
        for i in due:
            prompt = prompts[i]
            seqs[i] = seq = new_sequence(cfg, 0, torch.tensor([prompt]), prompt, len(prompt) + NEW,
                                         full_window=True, shared=shared)  # fmt: skip
            seq.criteria = StoppingCriteriaList([EosTokenCriteria(model.generation_config.eos_token_id)])
            if seeds is not None:
                seq.seed = seeds[i]
                seq.processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(20)])
        if due:
            engine.admit([seqs[i] for i in due], [prompts[i] for i in due])
        engine.step()
        step += 1
    return [seqs[i].committed[len(prompts[i]) :] for i in range(len(prompts))], stats


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("setting", [(4, 4, 4), (0, 4, 4)])
def test_sequences_joining_a_running_batch_match_generate_alone(arch, setting):
    model = tiny_model(arch)
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 7, 30, 12, 18))]
    arrivals = [0, 0, 3, 5, 11]  # two at once, then three joining a running batch
    cfg = LookaheadConfig(*setting)
    texts, stats = run_engine(model, cfg, prompts, arrivals)
    for prompt, text in zip(prompts, texts, strict=True):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
        assert text == expected[0, len(prompt) :].tolist(), (arch, setting)
    assert sum(stats.accepted_hist[1:]) > 0  # multi-token steps happened
    assert stats.sequence_steps > stats.steps  # and the sequences shared forward passes


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_a_sequence_left_alone_drafts_with_the_window_it_kept_in_the_batch(arch):
    """Adaptive settings with a window, as a server on CUDA runs them: while sequences share the
    batch the chooser steps them, window and all; once one is left alone the drafter takes over
    and its window (filled in the batch) rides on the drafted steps. Every text is generate's.
    Chooser and drafter price with one given flat curve: with the tiny model's measured one (a
    fresh cache's), the chooser could keep the batch's steps narrow and the window never filled."""
    model = tiny_model(arch)
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 7, 30))]
    cfg = LookaheadConfig(4, 4, 4, adaptive=True)
    flat = CostCurve(((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.2), (16, 1.4), (32, 2.0)))
    drafter = TreeDrafter(flat, max_nodes=4 * (cfg.max_emitted - 1), max_leaves=4)
    batched, drafted = set(), []  # sequences seen in a batch; (sequence, rider) per drafted step

    def watch(engine):
        step, draft = engine.step, drafter.draft

        def step_watched():
            if len(engine.active) > 1:
                batched.update(id(seq) for seq in engine.active)
            step()

        def draft_watched(sources, cap, leaves, rider):
            out = draft(sources, cap, leaves, rider)
            if out.candidates:
                drafted.append((id(engine.active[0]), rider))
            return out

        engine.step, drafter.draft = step_watched, draft_watched

    texts, stats = run_engine(model, cfg, prompts, [0, 0, 5], drafter=drafter, on_engine=watch, curve=flat)
    for prompt, text in zip(prompts, texts, strict=True):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
        assert text == expected[0, len(prompt) :].tolist(), arch
    full = build_layout(1, 4, 3).length - 1  # the window's rows once it has its N - 1 levels
    assert any(seq in batched and rider == full for seq, rider in drafted), "no drafted step after a batch"


def test_a_lone_request_with_a_narrower_window_drafts_and_pays_for_its_own_width_only():
    """A request may cap W below the server's: alone, its drafted steps lay out and price its own
    columns, not the server's (filler columns would cost rows and buy nothing). Its own N caps its
    drafted candidates at N - 1 tokens; settings it leaves out are the server's (drafts then run to
    the draft length)."""
    model = tiny_model("llama")
    cfg = LookaheadConfig(4, 4, 4, adaptive=True)
    service = Service(model, cfg, max_batch_size=2, max_queue=4)
    try:
        drafter, runner = service.engine.drafter, service.engine.runner
        riders, widths, caps_seen = [], [], []
        draft, step = drafter.draft, runner.step

        def draft_watched(sources, cap, leaves, rider):
            riders.append(rider)
            caps_seen.append(cap)
            return draft(sources, cap, leaves, rider)

        drafter.draft = draft_watched
        runner.step = lambda layout, ids: (widths.append(len(layout.last_level_slots)), step(layout, ids))[1]
        prompt = repetitive_prompt(24, 1)[0].tolist()

        async def main(caps):
            request = Request(prompt_ids=prompt, max_tokens=NEW, lookahead=caps)
            service.submit(request)
            tokens, reason = [], None
            while reason is None:
                event = await request.events.get()
                tokens, reason = tokens + event.tokens, event.finish_reason
            return tokens

        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
        narrow = build_layout(1, 2, 3).length - 1
        cases = [((2, 4, 4), narrow, 2, 3), ((2, None, None), narrow, 2, cfg.draft_length), (None, 11, 4, 7)]
        for caps, rows, width, longest in cases:
            riders.clear()
            widths.clear()
            caps_seen.clear()
            assert asyncio.run(main(caps)) == expected.tolist(), caps
            assert riders and set(riders) == {rows}, caps  # the window, full from the start, priced at its width
            assert width in widths and max(widths) == width, caps  # and laid out at it
            assert max(caps_seen) == longest, caps  # the request's own N - 1, else the draft length
    finally:
        service.shutdown(timeout=30)


def test_a_service_keeps_nothing_of_a_finished_request():
    """A server runs for days: once a request has finished, nothing of it (its sequence, its
    stopping criteria) stays reachable from the service."""
    model = tiny_model("llama")
    service = Service(model, LookaheadConfig(0, 4, 4, adaptive=True), max_batch_size=2, max_queue=4)
    try:
        prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 12, 18))]

        async def main():
            refs = []
            for prompt in prompts:
                request = Request(prompt_ids=prompt, max_tokens=NEW)
                service.submit(request)
                while not (await request.events.get()).finish_reason:
                    pass
                refs.append((weakref.ref(request.seq), weakref.ref(request.seq.criteria)))
            return refs

        refs = asyncio.run(main())
        gc.collect()
        # the engine's drafter remembers the last sequence it drafted for; none before it
        assert all(ref() is None for pair in refs[:-1] for ref in pair), [(a(), b()) for a, b in refs]
    finally:
        service.shutdown(timeout=30)


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_without_lookahead():
    """Noise keyed by (seed, position): the text depends on the seed and prompt only."""
    model = tiny_model("llama")
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 9, 17))]
    seeds = [11, 12, 13]
    alone = [run_engine(model, LookaheadConfig(0, 4, 4), [p], [0], seeds=[s], temperature=0.7)[0][0]
             for p, s in zip(prompts, seeds, strict=True)]  # fmt: skip
    batched, stats = run_engine(model, LookaheadConfig(4, 4, 4), prompts, [0, 2, 5], seeds=seeds, temperature=0.7)
    plain = [_generate_with_position_noise(model, p, s, 0.7) for p, s in zip(prompts, seeds, strict=True)]
    assert batched == alone == plain
    assert sum(stats.accepted_hist[1:]) > 0
    other, _ = run_engine(model, LookaheadConfig(0, 4, 4), prompts[:1], [0], seeds=[99], temperature=0.7)
    assert other[0] != alone[0]


def _generate_with_position_noise(model, prompt, seed, temperature):
    """Without lookahead: transformers' own greedy loop over the processed logits plus the noise
    of (seed, position) (the engine's rule, written out apart from it), up to EOS or NEW tokens."""
    from transformers import LogitsProcessor

    class PositionNoise(LogitsProcessor):
        def __call__(self, input_ids, scores):  # scores [1, V]; the token drawn sits at input_ids' length
            return scores.double() + position_noise(seed, input_ids.shape[1], scores.shape[-1])

    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(20), PositionNoise()])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, logits_processor=processors)
    return out[0, len(prompt) :].tolist()


def test_position_noise_samples_the_processed_distribution_exactly():
    """Gumbel-max with position-keyed noise: over many seeds, the token drawn from fixed logits
    follows softmax(logits) (chi-square). Adding the noise to probabilities instead of logits,
    a plausible slip, fails the same test."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.8])
    probs = torch.softmax(logits.double(), dim=-1)

    def chi2_pvalue(scores: torch.Tensor) -> float:
        counts = collections.Counter(
            int((scores + position_noise(seed, 5, len(logits))).argmax()) for seed in range(4000)
        )
        expected = probs * 4000
        stat = sum((counts.get(i, 0) - e) ** 2 / e for i, e in enumerate(expected.tolist()))
        # survival function of chi-square with 7 degrees of freedom (Wilson-Hilferty)
        k = len(logits) - 1
        z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
        return 0.5 * math.erfc(z / math.sqrt(2))

    assert chi2_pvalue(logits.double()) > 1e-3
    assert chi2_pvalue(probs) < 1e-6  # the slip is caught
    # positions draw independent noise; the same (seed, position) the same noise
    assert not torch.equal(position_noise(1, 5, 8), position_noise(1, 6, 8))
    assert torch.equal(position_noise(1, 5, 8), position_noise(1, 5, 8))


def test_position_noise_uses_every_bit_of_the_seed():
    """torch's CPU generator keeps 32 bits of its seed: with a linear key, seeds equal modulo 2**32
    drew the same noise at every position (two 40-token texts from two torch seeds came out the
    same), and one seed's noise was another's one position on. Hashed, they differ."""
    firsts = {tuple(position_noise(12345 + k * 2**32, 0, 8).tolist()) for k in range(64)}
    assert len(firsts) == 64
    assert not torch.equal(position_noise(2709260366, 0, 8), position_noise(12345, 1, 8))  # one such pair
    assert {tuple(position_noise(-seed, 3, 8).tolist()) for seed in range(1, 33)}.isdisjoint(
        {tuple(position_noise(seed, 3, 8).tolist()) for seed in range(1, 33)}
    )  # negative seeds (a request may send one) are seeds of their own


def test_shared_pool_raises_acceptance_without_changing_outputs():
    model = tiny_model("llama")
    prompt = repetitive_prompt(20, 3)[0].tolist()
    cfg = LookaheadConfig(0, 4, 4, seed_pool_from_prompt=False, pool_from_output=False, context_lookup=False)
    shared = SharedPool()
    first, _ = run_engine(model, cfg, [prompt], [0], shared=shared)
    shared.add_text(prompt + first[0])  # what the service does when a request finishes
    again, warm = run_engine(model, cfg, [prompt], [0], shared=shared)
    cold_text, cold = run_engine(model, cfg, [prompt], [0])
    assert again == first == cold_text
    assert warm.steps < cold.steps


def test_shared_pool_is_bounded_by_entries_and_bytes():
    pool = SharedPool(max_entries=50, span=4)
    pool.add_text(list(range(100)))
    assert len(pool) == 50
    assert pool.candidates([97, 98], length=4, limit=2) == [(99,)]  # the newest survive
    assert pool.candidates([3], length=4, limit=2) == []  # the oldest went first
    small = SharedPool(max_bytes=2000, span=4)
    small.add_text(list(range(100)))
    assert small.nbytes <= 2000 and len(small) > 0
    with pytest.raises(ValueError):
        SharedPool(max_entries=0)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) if i < 26 else "\ufffd" for i in ids)


def test_text_decoder_holds_back_stop_prefixes_and_cuts_at_the_stop():
    decoder = TextDecoder(CharTokenizer(), stop=["cde"])
    assert decoder.push([0, 1]) == "ab"
    assert decoder.push([2]) == ""  # "c" may start "cde"
    assert decoder.push([3, 25]) == "cdz" and not decoder.stopped  # "cdz" cannot grow into "cde"
    decoder = TextDecoder(CharTokenizer(), stop=["cde"])
    pieces = [decoder.push([i]) for i in (0, 1, 2, 3, 4, 5)]
    assert "".join(pieces) + decoder.flush() == "ab" and decoder.stopped
    assert decoder.tokens_used == 5  # the token that completed the stop string counts
    plain = TextDecoder(CharTokenizer())
    assert plain.push([0, 30]) == "a"  # an incomplete character is held back
    assert plain.push([30]) == ""  # byte-fallback tokenizers: one U+FFFD per missing byte, all held
    assert plain.flush() == "\ufffd\ufffd"


def test_overlapping_stop_strings_cut_alike_however_the_tokens_are_grouped():
    """A step brings one token or several, depending on the batch: the stop completed first wins
    either way ("abcdefgh" holds "bcdefg", which starts first, and "cd", which completes first)."""
    text = [0, 1, 2, 3, 4, 5, 6, 7]  # "abcdefgh"
    cuts = set()
    for size in (1, 2, 3, 8):
        decoder = TextDecoder(CharTokenizer(), stop=["bcdefg", "cd"])
        pieces = [decoder.push(text[i : i + size]) for i in range(0, len(text), size)]
        cuts.add(("".join(pieces) + decoder.flush(), decoder.tokens_used))
    assert cuts == {("ab", 4)}


def test_a_failed_admission_fails_the_newcomers_only():
    """A newcomer's prefill runs on its own before anything of the running batch is touched: when
    it fails (out of memory on a long prompt), the requests already running go on, exactly."""
    from lookahead.runner import DecoderRunner

    model = tiny_model("llama")
    service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=4, max_queue=4)
    prefill = DecoderRunner.prefill

    def failing(self, prompts, media=None):
        if any(len(p) == 11 for p in prompts):
            raise RuntimeError("simulated out of memory")
        return prefill(self, prompts, media)

    running, doomed = repetitive_prompt(24, 0)[0].tolist(), repetitive_prompt(11, 1)[0].tolist()
    long = 200

    async def main():
        first = Request(prompt_ids=running, max_tokens=long)
        service.submit(first)
        event = await first.events.get()  # it runs: now the newcomer comes
        newcomer = asyncio.create_task(ask(service, doomed))
        tokens, reason = list(event.tokens), event.finish_reason
        while reason is None:
            event = await first.events.get()
            tokens, reason = tokens + event.tokens, event.finish_reason
        return (tokens, reason), await newcomer

    DecoderRunner.prefill = failing
    try:
        (tokens, reason), (lost, error) = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        DecoderRunner.prefill = prefill
        service.shutdown(timeout=30)
    expected = model.generate(torch.tensor([running]), max_new_tokens=long, do_sample=False)
    assert tokens == expected[0, len(running) :].tolist() and reason in ("length", "stop")
    assert lost == [] and error.startswith("error:") and "simulated out of memory" in error


def test_a_request_whose_settings_cannot_be_built_fails_alone():
    """A request whose sampling processors refuse its settings (a top_k of -1, sent by a program
    embedding the service) fails before anything runs; the request running beside it goes on,
    exactly. An integer temperature (a generation_config may hold 1 for 1.0) samples."""
    model = tiny_model("llama")
    service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=4, max_queue=4)
    running, other = repetitive_prompt(24, 0)[0].tolist(), repetitive_prompt(11, 1)[0].tolist()
    long = 200

    async def collect(request):
        tokens, reason = [], None
        while reason is None:
            event = await request.events.get()
            tokens, reason = tokens + event.tokens, event.finish_reason
        return tokens, reason

    async def main():
        first = Request(prompt_ids=running, max_tokens=long)
        service.submit(first)
        event = await first.events.get()  # it runs: now the newcomers come
        bad = Request(prompt_ids=other, max_tokens=8, temperature=0.5, top_k=-1)
        whole = Request(prompt_ids=other, max_tokens=8, temperature=1, seed=3)
        service.submit(bad)
        service.submit(whole)
        rest = await collect(first)
        return (event.tokens + rest[0], rest[1]), await collect(bad), await collect(whole)

    try:
        (tokens, reason), (lost, error), (sampled, sampled_reason) = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        service.shutdown(timeout=30)
    expected = model.generate(torch.tensor([running]), max_new_tokens=long, do_sample=False)
    assert tokens == expected[0, len(running) :].tolist() and reason in ("length", "stop")
    assert lost == [] and error.startswith("error:") and "top_k" in error
    assert len(sampled) == 8 and sampled_reason == "length"


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine():
    """A request's events go to its caller's event loop; one that closed while its request ran
    (the caller left without cancelling) cancels that request, and the engine serves the next."""
    model = tiny_model("llama")
    service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=2, max_queue=4)
    prompt = repetitive_prompt(24, 0)[0].tolist()

    async def leave_early():
        request = Request(prompt_ids=prompt, max_tokens=200)
        service.submit(request)
        await request.events.get()  # its first tokens came; the loop then closes under it

    try:
        asyncio.run(leave_early())
        tokens, reason = asyncio.run(asyncio.wait_for(ask(service, prompt), 60))
        assert service._thread.is_alive()
    finally:
        service.shutdown(timeout=30)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    assert tokens == expected[0, len(prompt) :].tolist() and reason in ("length", "stop")


def test_the_model_s_own_generation_config_processors_apply_to_every_request():
    """A model may ship a repetition_penalty (Qwen2.5-Instruct does): plain generate applies it, so
    the service does too, with no_repeat_ngram_size and min_new_tokens."""
    model = tiny_model("llama")
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.update(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5)
    service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=2, max_queue=4)
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 12))]
    try:

        async def both():
            return await asyncio.gather(*(ask(service, p) for p in prompts))

        results = asyncio.run(asyncio.wait_for(both(), 120))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
            assert tokens == expected[0, len(prompt) :].tolist()
        assert any(  # without the processors the text differs: they mattered here
            tokens != model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, repetition_penalty=1.0,
                                     no_repeat_ngram_size=0, min_new_tokens=0)[0, len(p) :].tolist()
            for p, (tokens, _) in zip(prompts, results, strict=True)
        )  # fmt: skip
    finally:
        service.shutdown(timeout=30)
        model.generation_config = saved


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    """logits / 1e-45 overflow to inf and the draw turns to garbage: such a request is greedy."""
    from lookahead.api import parse_request

    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}
    for value, expected in ((1e-45, 0.0), (0.0, 0.0), (0.5, 0.5)):
        assert parse_request({**body, "temperature": value}, False, "m", None, 512, 16, 96).temperature == expected


def test_sampling_fields_a_request_leaves_out_come_from_the_server_defaults():
    """A model's generation_config may set temperature/top_p/top_k (Qwen2.5-Instruct: 0.7, 0.8, 20):
    a request that leaves one out gets the model's, as vLLM and SGLang serve it; what it sets wins."""
    from transformers import GenerationConfig

    from lookahead.api import SamplingDefaults, parse_request

    model_defaults, skipped = SamplingDefaults.from_generation_config(
        GenerationConfig(temperature=0.7, top_p=0.8, top_k=20)
    )
    assert model_defaults == SamplingDefaults(0.7, 0.8, 20) and skipped == []
    assert SamplingDefaults.from_generation_config(GenerationConfig()) == (SamplingDefaults(), [])
    whole, _ = SamplingDefaults.from_generation_config(GenerationConfig(temperature=1, top_p=1))
    assert type(whole.temperature) is float and type(whole.top_p) is float  # transformers' warpers take floats
    odd, skipped = SamplingDefaults.from_generation_config(GenerationConfig(temperature=3.0, top_p=1.5, top_k=0))
    assert odd == SamplingDefaults() and skipped == ["temperature=3.0", "top_p=1.5"]  # top_k 0: no cut

    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}

    def parse(extra, defaults):
        parsed = parse_request({**body, **extra}, False, "m", None, 512, 16, 96, defaults)
        return parsed.temperature, parsed.top_p, parsed.top_k

    assert parse({}, model_defaults) == (0.7, 0.8, 20)
    assert parse({}, SamplingDefaults()) == (1.0, 1.0, None)  # OpenAI's
    assert parse({"temperature": 0.2, "top_k": 0}, model_defaults) == (0.2, 0.8, None)  # the request's own win
    assert parse({"temperature": 0}, model_defaults)[0] == 0.0  # greedy stays greedy


def test_chat_template_errors_are_400_naming_messages():
    from lookahead.api import ApiError, parse_request

    class Refusing:
        chat_template = "..."

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(ApiError) as info:
        parse_request(body, True, "m", Refusing(), 512, 16, 96)
    assert info.value.status == 400 and info.value.param == "messages" and "alternate" in info.value.message


async def ask(service, prompt, delay=0.0, cancel=False):
    """Submit ``prompt`` to ``service`` after ``delay`` s -> (tokens, finish reason); with ``cancel``,
    cancel it once the first tokens arrived -> (those tokens, the request)."""
    await asyncio.sleep(delay)
    request = Request(prompt_ids=prompt, max_tokens=NEW)
    service.submit(request)
    tokens, reason = [], None
    while reason is None:
        event = await request.events.get()
        tokens += event.tokens
        reason = event.finish_reason
        if cancel and tokens:
            service.cancel(request)
            return tokens, request
    return tokens, reason


def test_service_admits_requests_as_they_arrive_and_frees_cancelled_ones():
    """The service's engine thread, driven from an event loop as the server drives it."""
    model = tiny_model("llama")
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 7, 30, 12))]
    service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=3, max_queue=8, shared_pool=SharedPool())

    async def main():
        jobs = [ask(service, p, 0.02 * i) for i, p in enumerate(prompts)] + [ask(service, prompts[0], cancel=True)]
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(main())
        for prompt, (tokens, reason) in zip(prompts, results, strict=False):
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
            assert tokens == expected[0, len(prompt) :].tolist()
            assert reason in ("length", "stop")
    finally:
        service.shutdown(timeout=30)
    assert service.active == 0 and service.queue_depth == 0
    # the cancelled request left the batch at the next step boundary: it took at most one step
    # after its first tokens (up to N = 4 tokens), far from its 30, and says why it left
    cancelled = results[-1][1].seq
    assert cancelled.cancelled and cancelled.finished
    assert len(cancelled.committed) - len(prompts[0]) <= len(results[-1][0]) + 4 < NEW


def test_service_drafts_a_lone_request_and_batches_the_rest():
    """With adaptive settings the service drafts a lone request's steps token by token (as
    Lookahead() does) and hands the steps back to the chooser while others share the batch;
    every text is plain generate's."""
    model = tiny_model("llama")
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((30, 12, 24, 18))]
    service = Service(model, LookaheadConfig(0, 4, 4, adaptive=True), max_batch_size=4, max_queue=8)

    async def main():
        alone = [await ask(service, p) for p in prompts[:2]]  # each the only request: drafted
        together = await asyncio.gather(*(ask(service, p) for p in prompts[2:]))  # a batch: the chooser's
        return [*alone, *together]

    try:
        drafter = service.engine.drafter
        assert drafter is not None
        # the drafter's pending tries are scored along one text: whenever the lone sequence changes
        # (or its steps went undrafted in a batch) the engine has it forget them
        lone, forgets = [], []
        draft, forget = drafter.draft, drafter.forget_pending
        drafter.forget_pending = lambda: (forgets.append(len(lone)), forget())[1]
        drafter.draft = lambda *args: (lone.append(service.engine.active[0]), draft(*args))[1]
        texts = asyncio.run(main())
        for prompt, (tokens, _) in zip(prompts, texts, strict=True):
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
            assert tokens == expected[0, len(prompt) :].tolist()
        assert drafter.wide_steps > 0  # the lone request's steps were drafted
        assert sum(drafter.chosen.values()) < service.stats.steps  # not every step: the batch's were chosen
        assert service.engine.chooser.chosen  # by the chooser
        changes = [i for i in range(len(lone)) if i == 0 or lone[i] is not lone[i - 1]]
        assert len(changes) >= 2 and set(changes) <= set(forgets)  # the second lone request forgot the first's
    finally:
        service.shutdown(timeout=30)


def test_a_service_can_load_its_model_and_runs_every_forward_pass_on_its_engine_thread():
    """``Service(load, ...)``: the model is loaded, checked, calibrated and stepped on one thread,
    the engine's (a second thread with torch work of its own slows every CPU forward pass, see
    lookahead.service); the greedy text is generate's, and what loading raises reaches the caller."""
    import threading

    threads, hooks, loaded_on = set(), [], []

    def load():
        loaded_on.append(threading.current_thread().name)
        model = tiny_model("llama")  # cached and shared with other tests: the hook is removed below
        hooks.append(model.register_forward_pre_hook(lambda *_: threads.add(threading.current_thread().name)))
        return model

    service = Service(load, LookaheadConfig(0, 4, 4, adaptive=True), max_batch_size=2)
    try:
        assert loaded_on == ["lookahead-engine"]
        assert threads <= {"lookahead-engine"}  # the model's check and calibration, where not cached
        prompt = repetitive_prompt(24, 3)[0].tolist()
        got, _ = asyncio.run(ask(service, prompt))
    finally:
        service.shutdown(timeout=30)
        for hook in hooks:
            hook.remove()
    assert threads == {"lookahead-engine"}
    expected = service.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
    assert got == expected.tolist()

    def broken():
        raise FileNotFoundError("no such checkpoint")

    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        Service(broken, LookaheadConfig(0, 4, 4))
    with pytest.raises(ValueError, match="decoder-only"):  # refused on the engine thread, raised here
        Service(lambda: tiny_seq2seq("t5"), LookaheadConfig(0, 4, 4))
