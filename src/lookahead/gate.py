"""Turn the lookahead and verification branches off while they do not pay.

A *wide* step (t plus window and candidates) costs more than a *plain* one-token step and emits
more tokens. It pays when

    tokens per wide step / seconds per wide step  >=  1 / seconds per plain step.

The gate measures both kinds of step during the call (exponential moving averages) and runs the
cheaper one per token. Whichever kind is not chosen is re-measured now and then, so that a change
of text (say, from prose into code the prompt already holds) is noticed: plain steps every
``probe_every`` wide steps, wide steps after ``probe_every`` plain steps, an interval that doubles
(up to ``max_interval``) each time a wide probe still does not pay, since each costs a wide step.
The output never depends on the gate: only the speed does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepGate:
    enabled: bool = True
    probe_every: int = 8  # after this many steps of one kind, run one of the other kind
    max_interval: int = 64  # longest wait between wide probes while they do not pay
    smoothing: float = 0.3  # weight of the newest measurement
    wide_seconds: float | None = None
    wide_tokens: float | None = None
    plain_seconds: float | None = None
    _streak: int = 0
    _last_wide: bool = True
    _interval: int = 0  # current wait between wide probes (0 until the first probe)
    wide_steps: int = 0
    plain_steps: int = 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def pays(self) -> bool:
        """Whether wide steps currently give more tokens per second than plain ones."""
        if self.wide_seconds is None or self.plain_seconds is None:
            return True
        return self.wide_tokens / self.wide_seconds >= 1.0 / self.plain_seconds

    def wide(self) -> bool:
        """Should the next step be wide?"""
        if not self.enabled:
            return True
        if self.wide_seconds is None:
            return True  # measure a wide step first
        if self.plain_seconds is None:
            return False  # then a plain one
        preferred = self.pays()
        wait = self.probe_every if self._last_wide else max(self.probe_every, self._interval)
        if self._streak >= wait:
            return not self._last_wide  # probe the other kind
        return preferred

    def record(self, wide: bool, seconds: float, tokens: int) -> None:
        """Record a step: ``wide`` is whether it carried more than t."""
        if wide:
            probe = not self._last_wide
            self.wide_seconds = self._average(self.wide_seconds, seconds)
            self.wide_tokens = self._average(self.wide_tokens, float(tokens))
            self.wide_steps += 1
            if probe and self.plain_seconds is not None:  # back off while probes keep failing
                paid = self.pays()
                self._interval = 0 if paid else min(self.max_interval, 2 * max(self._interval, self.probe_every // 2))
        else:
            self.plain_seconds = self._average(self.plain_seconds, seconds)
            self.plain_steps += 1
        self._streak = self._streak + 1 if wide == self._last_wide else 1
        self._last_wide = wide
