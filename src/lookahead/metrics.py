"""Prometheus metrics of a server (``GET /metrics``), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """Counters the engine thread and the request handlers update (prometheus_client is thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self._tokens = self._sequence_steps = 0  # running totals behind tokens_per_step
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lookahead_requests", "Generation requests accepted", ["endpoint"], registry=r)
        self.errors = Counter("lookahead_request_errors", "Requests answered with an error, by status", ["status"],
                              registry=r)  # fmt: skip
        self.active = Gauge("lookahead_active_sequences", "Sequences in the running batch", registry=r)
        self.queued = Gauge("lookahead_queue_depth", "Requests waiting to join the batch", registry=r)
        self.tokens = Counter("lookahead_generated_tokens", "Tokens generated", registry=r)
        self.forward_passes = Counter("lookahead_forward_passes", "Forward passes (prefills included)", registry=r)
        self.sequence_steps = Counter(
            "lookahead_sequence_steps", "Forward passes times the sequences each carried", registry=r
        )
        self.tokens_per_step = Gauge(
            "lookahead_tokens_per_step", "Generated tokens per sequence and forward pass, since start", registry=r
        )
        self.step_seconds = Histogram(
            "lookahead_step_seconds",
            "Time of one engine iteration (admission prefill and one step)",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )

    def on_step(self, seconds: float, active: int, forward_passes: int, sequence_steps: int, tokens: int) -> None:
        """What one engine iteration did (called from the engine thread)."""
        self._tokens += tokens
        self._sequence_steps += sequence_steps
        self.step_seconds.observe(seconds)
        self.active.set(active)
        self.forward_passes.inc(forward_passes)
        self.sequence_steps.inc(sequence_steps)
        self.tokens.inc(tokens)
        if self._sequence_steps:
            self.tokens_per_step.set(self._tokens / self._sequence_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
