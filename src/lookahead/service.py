"""Continuous batching for a server: one engine thread, requests joining and leaving at step
boundaries, and a warm n-gram pool shared across requests.

The engine runs in a thread of its own (torch releases the GIL in its kernels), so the web
server's event loop stays free. Every forward pass of the service runs there, its model checks and
cost calibration included, and so can the model's loading (pass a function that loads it): on a
CPU, torch's OpenMP runtime (GNU libgomp) keeps a team of worker threads per thread that has run
parallel work, and once a process holds more such workers than it has CPUs, every team stops
spin-waiting between parallel regions and sleeps instead. With SmolLM2 in bf16 on 2 cores, a
service given a model loaded on the main thread took 60 ms per token, one that loaded it on its
engine thread 38 (``benchmarks/thread_cost.py``).

A request is queued by :meth:`Service.submit`; at the next step boundary the thread admits queued
requests up to ``max_batch_size`` (prefilling them together), then steps the batch. After every
step each request's new tokens go to its own ``asyncio.Queue`` as :class:`Event` objects; the last
one says why it finished. A cancelled request (a client that went away) leaves the batch at the
next step boundary. What a request's sequence runs with (its settings, sampling, stopping and the
model's own logits processors) is :mod:`lookahead.sequence_setup`'s; which queued requests a step
prefills, :mod:`lookahead.admission_plan`'s.

A vision-language model's requests (:func:`lookahead.media.takes_images`), text-only ones too,
are each prefilled alone and whole, as the model's own ``generate`` prefills them
(:meth:`MediaPrefill.from_inputs <lookahead.media.MediaPrefill.from_inputs>`: its vision tower
reads the request's images, and its positions are its own), then join the batch; a prefill that
fails (an image the vision tower refuses, memory run out) fails its request alone.

Each request carries its own settings: ``max_tokens``, greedy or sampling (``temperature``,
``top_p``, ``top_k``), a ``seed`` and a cap on W/N/G. A sampled request draws each token from
noise keyed by (seed, position) (``verify.position_noise``), so the same seed gives the same text
alone or in any batch, with or without lookahead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .admission_plan import StepPlan, plan_step, plan_whole
from .assembly import make_chooser, make_drafter, settle
from .config import LookaheadConfig, LookaheadStats
from .emission import Emitter
from .engine import ChunkedPrefill, Engine
from .media import MediaPrefill, takes_images
from .pool import PoolFeed, SharedPool
from .runner import AdmissionError
from .sequence_setup import SequenceSetup, not_applied
from .sequences import SeqState
from .support import check_model

logger = logging.getLogger(__name__)

# `lookahead serve --plain`, the baseline: the same engine with one-token steps (no candidates, no
# window, no pools)
PLAIN_CONFIG = LookaheadConfig(0, 2, 0, seed_pool_from_prompt=False, pool_from_output=False, context_lookup=False)


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be admitted; retry later."""


class ShuttingDownError(RuntimeError):
    """The service no longer admits requests."""


@dataclass
class Event:
    tokens: list[int]  # tokens emitted by the last step
    finish_reason: str | None = None  # "stop" (EOS), "length", or None while running


@dataclass
class Request:
    """One generation request and what the engine thread reports back."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    lookahead: tuple[int | None, int | None, int | None] | None = None  # (W, N, G) caps; None: the server's
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    seq: SeqState | None = None
    sent: int = 0  # tokens already reported
    cancelled: bool = False
    checked_at: float = 0.0  # when the server last checked that the client is still connected
    pool_scope: str | None = None  # whose warm pool it reads and feeds (Service's pool_scopes)
    kept: int | None = None  # ended on a stop string after this many tokens (Service.stop)
    # a VLM's processor output for its prompt and images (tensors of batch 1, input_ids among them);
    # None: prompt_ids alone
    media: dict | None = None

    def settings(self, cfg: LookaheadConfig) -> tuple[int, int, int]:
        """The (W, N, G) this request runs with: its own caps within the server's."""
        own = self.lookahead or (None, None, None)
        server = (cfg.window_size, cfg.ngram_size, cfg.max_candidates)
        return tuple(cap if value is None else min(value, cap) for value, cap in zip(own, server, strict=True))


class Service:
    """The engine thread and its queue. ``model``: the model, or a function without arguments that
    loads and returns it, called on the engine thread (see the module docstring: where a process
    does its CPU work in torch on one thread, it runs at full speed); ``cfg`` is the server's
    lookahead setting (``plain``: one-token steps only, the baseline); ``shared_pool`` the warm
    pool, or None. The constructor returns once the engine is ready, raising what loading or
    checking the model raised."""

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        cfg: LookaheadConfig,
        *,
        max_batch_size: int = 8,
        max_queue: int = 64,
        shared_pool: SharedPool | None = None,
        pool_scopes: bool = False,
        prefill_chunk: int = 512,
        stall_seconds: float = 120.0,
        on_step=None,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.cfg = cfg
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        # the warm pool: one for every request, or (pool_scopes) one per Request.pool_scope, each
        # with shared_pool's bounds
        self.shared_pool, self.pool_scopes = shared_pool, pool_scopes
        self._pools: dict[str | None, SharedPool] = {}
        self._feeding = PoolFeed()  # finished texts on their way into a warm pool
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled per step, at most
        self._prefilling: tuple[Request, ChunkedPrefill] | None = None  # a long prompt, chunk by chunk
        self.stall_seconds = stall_seconds
        self._progress_at = time.monotonic()  # when the engine thread last finished a step or woke
        self._stepping = False  # the engine thread is in a step (or its prefills)
        self.on_step = on_step  # on_step(seconds, active, forward passes, sequence steps, tokens): metrics
        self._pending: deque[Request] = deque()
        self._by_seq: dict[int, Request] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._abandon = False  # shutdown's drain timed out: fail what is left and stop
        ready, failed = threading.Event(), []
        self._thread = threading.Thread(
            target=self._main, args=(model, ready, failed), name="lookahead-engine", daemon=True
        )
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            raise failed[0]

    def _setup(self, model: torch.nn.Module) -> None:
        """Check the model, calibrate its costs (one sequence, and batches of up to ``max_batch_size``)
        and build the engine (on the engine thread)."""
        self.model, cfg = model, self.cfg
        spec = check_model(model)
        if spec.encoder_decoder:
            raise ValueError("the server runs decoder-only models (requests join a batch mid-way)")
        self.spec = spec
        self.vlm = takes_images(model)  # each request is prefilled alone, as its generate would (_admit_media)
        if spec.context_limit != spec.max_positions:
            logger.warning(
                "this model's rotary embedding changes once a forward pass reaches position %d (longrope or "
                "dynamic RoPE), which would change every sequence of a shared batch: requests are limited to "
                "%d tokens, prompt and output together",
                spec.rope_threshold,
                spec.context_limit,
            )
        self.cfg = cfg = settle(cfg, spec)  # models without position_ids take linear steps
        self.stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.max_emitted)
        chooser = make_chooser(model, cfg, spec, 1, largest_batch=self.max_batch_size)
        # a lone request's steps are drafted token by token, as Lookahead() drafts them; the drafter's
        # learnt rates carry from one request to the next
        drafter = make_drafter(cfg, spec, 1, chooser.curve)
        self.engine = Engine(
            model, cfg, spec, chooser, Emitter(), self.stats, on_finish=self._finished, drafter=drafter
        )
        self.setup = SequenceSetup(model, cfg)
        ignored = not_applied(model.generation_config)
        if ignored:
            logger.warning(
                "the model's generation_config sets %s, which this server does not apply: its greedy text "
                "differs from model.generate's where they matter (clear them on the model to match)",
                ", ".join(ignored),
            )

    # -- called from the event loop ------------------------------------------------------------

    def submit(self, request: Request) -> None:
        request.loop = asyncio.get_running_loop()
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(f"{len(self._pending)} requests are already waiting")
            self._pending.append(request)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """Free the request's sequence at the next step boundary (or drop it from the queue)."""
        with self._cond:
            request.cancelled = True
            if request in self._pending:
                self._pending.remove(request)
            self._cond.notify()

    def stop(self, request: Request, tokens: int) -> None:
        """The request's text ended on a stop string after its first ``tokens`` tokens: its
        sequence leaves at the next step boundary, and its prompt and those tokens feed the warm
        pool, as a finished request's do."""
        with self._cond:
            request.kept = tokens
        self.cancel(request)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self.engine.active)

    def health(self) -> dict:
        """Whether the engine thread is alive and making progress: ``ok`` is False once it has
        stopped, or when it has had work for ``stall_seconds`` without finishing a step."""
        reason = None
        if not self._thread.is_alive():
            reason = "the engine thread has stopped"
        elif self._busy and time.monotonic() - self._progress_at > self.stall_seconds:
            reason = f"no engine step has finished for over {self.stall_seconds:g} s"
        pools = [self.shared_pool] if not self.pool_scopes else list(self._pools.values())
        return {
            "ok": reason is None,
            "reason": reason,
            "active": self.active,
            "queued": self.queue_depth,
            "pool_entries": sum(len(pool) for pool in pools if pool is not None),
        }

    @property
    def _busy(self) -> bool:
        return bool(self._stepping or self._pending or self.engine.active or self._prefilling)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting and let what is in flight finish, for at most ``timeout`` seconds (None:
        however long it takes); then every request still in flight fails with a final event saying
        so, and the thread stops."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify()
            self._thread.join()

    # -- the engine thread -----------------------------------------------------------------------

    def _main(self, model, ready: threading.Event, failed: list) -> None:
        try:
            self._setup(model if isinstance(model, torch.nn.Module) else model())
        except BaseException as err:  # the constructor raises it
            failed.append(err)
            return
        finally:
            ready.set()
        try:
            self._run()
        except BaseException as err:  # its own loop failed: say so, and leave no request waiting
            logger.critical("the engine thread stopped", exc_info=err)
            with self._cond:
                self._stopping, waiting = True, list(self._pending)
                self._pending.clear()
            self._fail_all(waiting, err)
            raise

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._busy or self._feeding or self._stopping):
                        self._cond.wait()
                        self._progress_at = time.monotonic()
                    if self._abandon or (self._stopping and not self._busy):
                        break
                    plan = self._plan()
                for request in self._by_seq.values():
                    if request.cancelled:
                        self.engine.cancel(request.seq)
                self._stepping = True
                try:
                    self._advance(plan)
                except Exception as err:  # fail every request in flight rather than hang them
                    logger.exception("engine step failed")
                    try:
                        self._fail_all(plan.newcomers, err)
                    except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                        logger.exception("could not report the failure")
                self._feed_pools()
                self._progress_at, self._stepping = time.monotonic(), False
            if self._abandon:
                self._fail_all(list(self._pending), ShutdownTimeout("the server shut down before the request finished"))

    def _plan(self) -> StepPlan:
        """What this step prefills (:mod:`lookahead.admission_plan`). Called with the lock held."""
        room = self.max_batch_size - len(self.engine.active)
        if self.vlm:
            return plan_whole(self._pending, room, self.prefill_chunk)
        under_way = None if self._prefilling is None else self._prefilling[1].left
        return plan_step(self._pending, room, self.prefill_chunk, under_way)

    def _advance(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        stats = self.stats
        before = (stats.steps, stats.sequence_steps, stats.new_tokens)
        running = list(self._by_seq.values())
        joined = self._prefill_long(plan)
        newcomers = self._admit(self._set_up(plan.newcomers)) + joined
        if self.engine.active:
            self.engine.step()
        for request in running + newcomers:
            self._report(request)
        seconds = time.perf_counter() - start
        if seconds > self.SLOW_STEP:
            logger.warning(
                "an engine step took %.2f s: %d sequences over %d cache columns, %d newcomers prefilled together, "
                "%d tokens of a long prompt",
                seconds, len(self.engine.active), self.engine.runner.columns, len(plan.newcomers),
                plan.chunk if plan.start is None else plan.start[1],
            )  # fmt: skip
        if self.on_step is not None:
            after = (stats.steps, stats.sequence_steps, stats.new_tokens)
            deltas = [b - a for a, b in zip(before, after, strict=True)]
            self.on_step(seconds, len(self.engine.active), *deltas)

    def _prefill_long(self, plan: StepPlan) -> list[Request]:
        """The next chunk of the long prompt under way (or the first of a new one) -> [it] once it
        has joined the batch. A failure, or a cancellation, ends that request alone."""
        if plan.start is not None:
            request, _ = plan.start
            if self._set_up([request]):
                self._prefilling = (request, self.engine.prefill_apart(request.seq, request.prompt_ids))
                self._by_seq.pop(id(request.seq))  # it joins the batch when its prefill is done
        if self._prefilling is None:
            return []
        request, prefill = self._prefilling
        try:
            if request.cancelled:
                self._prefilling = None
                return []
            prefill.advance(plan.chunk if plan.start is None else plan.start[1])
            if prefill.left:
                return []
            self._prefilling = None
            self._by_seq[id(request.seq)] = request
            self.engine.join([request.seq], prefill.runner, prefill.logits)
        except AdmissionError as err:
            self._prefilling = None
            self._fail_alone(request, err)
            return []
        return [request]

    def _admit(self, newcomers: list[Request]) -> list[Request]:
        """Prefill ``newcomers`` together and let them join the batch -> those that did. Where that
        fails, each is tried alone, so that only the one whose prefill or merge fails (a prompt
        that runs out of memory, say) fails; the running requests go on."""
        if not newcomers:
            return []
        if self.vlm:
            return [request for request in newcomers if self._admit_media(request)]
        try:
            self.engine.admit([r.seq for r in newcomers], [r.prompt_ids for r in newcomers])
            return newcomers
        except AdmissionError as err:
            if len(newcomers) == 1:
                self._fail_alone(newcomers[0], err)
                return []
        logger.warning("admitting %d requests together failed: trying each alone", len(newcomers))
        joined = []
        for request in newcomers:
            self._by_seq.pop(id(request.seq), None)
            request.seq = self._sequence(request)  # afresh: the failed try may have emitted its first token
            self._by_seq[id(request.seq)] = request
            joined += self._admit([request])
        return joined

    def _admit_media(self, request: Request) -> bool:
        """Prefill a VLM's request alone, as ``model.generate(**request.media)`` would, and let it
        join the batch -> whether it did. A failure fails it alone."""
        try:
            prefill = MediaPrefill.from_inputs(self.model, self._media_inputs(request))
            request.media = None  # its images are in the prefill now
            self.engine.admit([request.seq], [request.prompt_ids], prefill)
        except Exception as err:  # an image its vision tower refuses, memory run out: this request only
            self._fail_alone(request, err)
            return False
        return True

    def _media_inputs(self, request: Request) -> dict:
        """The request's model inputs (its prompt ids alone where it has no images) on the model's
        device, floating-point ones (pixels) in the model's dtype."""
        inputs = request.media or {"input_ids": torch.tensor([request.prompt_ids])}
        device, dtype = self.model.device, self.model.dtype
        return {
            name: value.to(device, dtype) if value.is_floating_point() else value.to(device)
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor)
        }

    def _fail_alone(self, request: Request, err: Exception) -> None:
        logger.error("admitting a request failed: %s", err, exc_info=err)
        self._by_seq.pop(id(request.seq), None)
        self._post(request, Event([], f"error: {err}"))

    def _set_up(self, newcomers: list[Request]) -> list[Request]:
        """Each newcomer's sequence; one whose settings cannot be built (its processors refuse
        them) fails alone, before anything runs, and the others go on."""
        ready = []
        for request in newcomers:
            try:
                request.seq = self._sequence(request)
            except Exception as err:
                logger.exception("setting up a request failed")
                self._post(request, Event([], f"error: {err}"))
                continue
            self._by_seq[id(request.seq)] = request
            ready.append(request)
        return ready

    def _sequence(self, request: Request) -> SeqState:
        return self.setup.sequence(request, self._pool_for(request.pool_scope))

    def _pool_for(self, scope: str | None) -> SharedPool | None:
        if self.shared_pool is None or not self.pool_scopes:
            return self.shared_pool
        if scope not in self._pools:
            self._pools[scope] = self.shared_pool.empty_like()
        return self._pools[scope]

    def _finished(self, seq: SeqState) -> None:
        """Called by the engine when a sequence leaves the batch: its text is queued for its warm
        pool (up to its stop string, where it ended on one; not at all where it was cancelled)."""
        request = self._by_seq.get(id(seq))
        pool = None if request is None else self._pool_for(request.pool_scope)
        if pool is None or (request.cancelled and request.kept is None):
            return
        text = seq.committed if request.kept is None else seq.committed[: len(request.prompt_ids) + request.kept]
        self._feeding.add(pool, text)

    SLOW_STEP = 2.0  # seconds: an engine step (prefills included) slower than this is logged

    POOL_FEED = 2048  # text positions added to warm pools per step, at most (about 15 ms here)

    def _feed_pools(self) -> None:
        """Add the next ``POOL_FEED`` positions of finished texts to their warm pools (``PoolFeed``)."""
        self._feeding.feed(self.POOL_FEED)

    def _report(self, request: Request) -> None:
        seq = request.seq
        new = seq.committed[len(request.prompt_ids) + request.sent :]
        request.sent += len(new)
        self.stats.new_tokens += len(new)
        reason = None
        if seq.finished:
            self._by_seq.pop(id(seq), None)
            if request.cancelled:
                return
            reason = "stop" if seq.stopped_at is not None else "length"
        if new or reason:
            self._post(request, Event(new, reason))

    def _post(self, request: Request, event: Event) -> None:
        """Hand ``event`` to the request's event loop; a loop that has closed (its caller left
        without cancelling) cancels the request instead of stopping the engine thread."""
        try:
            request.loop.call_soon_threadsafe(request.events.put_nowait, event)
        except RuntimeError:
            request.cancelled = True
            if request.seq is not None:
                self.engine.cancel(request.seq)

    def _fail_all(self, newcomers: list[Request], err: Exception) -> None:
        requests = {id(r): r for r in [*self._by_seq.values(), *newcomers]}
        if self._prefilling is not None:
            requests[id(self._prefilling[0])] = self._prefilling[0]
            self._prefilling = None
        self._by_seq.clear()
        self.engine.active = []
        for request in requests.values():
            self._post(request, Event([], f"error: {err}"))


class ShutdownTimeout(RuntimeError):
    """The server stopped before the request finished (its drain timed out)."""
