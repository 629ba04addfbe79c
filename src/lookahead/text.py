"""Incremental detokenization for streaming, with stop strings.

Tokens arrive a step at a time; the text sent so far never changes. A piece is held back while
it ends in an incomplete UTF-8 character or in what could be the start of a stop string. When a
stop string appears, the text ends just before it (OpenAI's rule) and ``stopped`` is set.

    >>> decoder = TextDecoder(tokenizer, stop=["\\n\\n"])
    >>> decoder.push(token_ids)        # the new text that is safe to send
"""

from __future__ import annotations

from collections.abc import Sequence


class TextDecoder:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # what has been handed out so far
        self.stopped = False
        self.tokens_used = 0  # tokens behind the text (up to the one that completed a stop string)
        self._full = ""

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped or not tokens:
            return ""
        self.tokens += [int(t) for t in tokens]
        full = self._decode(self.tokens)
        self.tokens_used = len(self.tokens)
        hits = [(full.find(s, max(0, len(self.text) - len(s))), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            # the stop completed first, as token-by-token decoding would find it: the cut must not
            # depend on how many tokens a step brought (overlapping stops, e.g. "fi" and "ef fibo")
            at, _ = min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
            self.stopped, full = True, full[:at]
            while self.tokens_used > 1 and any(
                s in self._decode(self.tokens[: self.tokens_used - 1]) for s in self.stop
            ):
                self.tokens_used -= 1
            return self._take(full, len(full))
        safe = len(full.rstrip("\ufffd"))  # byte-fallback tokenizers give one U+FFFD per missing byte
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._take(full, max(safe, len(self.text)))

    def flush(self) -> str:
        """At the end: whatever was held back."""
        return self._take(self._full, len(self._full))

    def _take(self, full: str, upto: int) -> str:
        self._full = full
        piece = full[len(self.text) : upto]
        self.text += piece
        return piece
