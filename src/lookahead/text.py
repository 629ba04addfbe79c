"""Incremental detokenization for streaming, with stop strings.

Tokens arrive a step at a time; the text sent so far never changes. A piece is held back while
it ends in an incomplete UTF-8 character or in what could be the start of a stop string. When a
stop string appears, the text ends just before it (OpenAI's rule) and ``stopped`` is set.

    >>> decoder = TextDecoder(tokenizer, stop=["\\n\\n"])
    >>> decoder.push(token_ids)        # the new text that is safe to send

Each token costs a bounded amount of work, however long the text: the tokenizer decodes a short
window of recent tokens (vLLM's and TGI's prefix and read offsets), and the stop strings are
looked for in the text not yet sent.
"""

from __future__ import annotations

from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # what a tokenizer decodes an incomplete character to (byte fallback: one per byte)


class Detokenizer:
    """Token ids to text, one token at a time, decoding a bounded window of recent tokens.

    Tokens ``[0, read)`` have given their final text. The new tokens ``[read, end)`` are decoded
    together with a few tokens before them, ``[prefix, read)``, whose text is cut off again: a
    tokenizer decodes a token differently at the start of a text (SentencePiece drops its leading
    space), and a character's bytes may span several tokens. A prefix starts where its text
    decodes cleanly (no U+FFFD), so never in the middle of a character."""

    CONTEXT = 4  # tokens before the new ones that the window decodes with them
    REACH = 4  # how much further back a clean start of the window is looked for
    MAX_PENDING = 8  # new tokens kept while their text ends in U+FFFD before some are settled
    KEEP = 4  # tokens left pending when settling: enough bytes for any incomplete character

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.returned = 0  # characters handed out
        self._prefix = self._read = 0
        self._prefix_text = ""
        self._given = 0  # characters of the text of tokens[read:] already handed out

    def decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text that no later token can change."""
        self.tokens.append(token)
        window = self.decode(self._prefix, len(self.tokens))
        out = ""
        if window.startswith(self._prefix_text):  # else the prefix's own bytes are still arriving
            tail = window[len(self._prefix_text) :]
            if not tail.endswith(INCOMPLETE):
                out = tail[self._given :]
                self._advance(len(self.tokens))
                return self._hand_out(out)
            complete = tail.rstrip(INCOMPLETE)  # what precedes an incomplete character is final
            out = complete[self._given :]
            self._given = max(self._given, len(complete))
        if len(self.tokens) - self._read > self.MAX_PENDING:  # bytes that never form a character
            out += self._settle(window)
        return self._hand_out(out)

    def flush(self) -> str:
        """At the end: the text still pending (U+FFFD for a character left incomplete)."""
        if self._read == len(self.tokens):
            return ""
        full = self.decode(0, len(self.tokens))  # once per request: exact whatever the tokenizer does
        self._advance(len(self.tokens))
        return self._hand_out(full[self.returned :])

    def _settle(self, window: str) -> str:
        """Hand out the text of all pending tokens but the last ``KEEP`` ones, whose bytes may
        still complete a character; that text is final once later bytes can no longer join it."""
        cut = len(self.tokens) - self.KEEP
        left = self.decode(self._prefix, cut)
        if left.startswith(self._prefix_text) and window.startswith(left):
            text = left[len(self._prefix_text) :]
        else:  # the window's text is not additive here: decode from the start, once
            text = self.decode(0, cut)[self.returned - self._given :]
        out, given = text[self._given :], max(0, self._given - len(text))
        self._advance(cut)
        self._given = given
        return out

    def _advance(self, read: int) -> None:
        self._read, self._given = read, 0
        start = max(0, read - self.CONTEXT)
        for prefix in range(start, max(-1, start - self.REACH - 1), -1):
            text = self.decode(prefix, read)
            if INCOMPLETE not in text:
                break
        else:  # no clean start nearby (bytes that form no character): the nearest one
            prefix, text = start, self.decode(start, read)
        self._prefix, self._prefix_text = prefix, text

    def _hand_out(self, text: str) -> str:
        self.returned += len(text)
        return text


class TextDecoder:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.stopped = False
        self.tokens_used = 0  # tokens behind the text (up to the one that completed a stop string)
        self._detokenizer = Detokenizer(tokenizer)
        self._pieces: list[str] = []  # what has been handed out so far
        self._held = ""  # decoded, not handed out: what may be the start of a stop string

    @property
    def text(self) -> str:
        """What has been handed out so far."""
        return "".join(self._pieces)

    @property
    def tokens(self) -> list[int]:
        return self._detokenizer.tokens

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        for token in tokens:  # one at a time: the stop completed first wins, however steps group tokens
            searched = len(self._held)
            self._held += self._detokenizer.push(int(token))
            self.tokens_used += 1
            at = self._find_stop(searched)
            if at is not None:
                self.stopped = True
                piece, self._held = self._held[:at], ""
                return self._take(piece)
        keep = self._stop_prefix_length()
        piece, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return self._take(piece)

    def flush(self) -> str:
        """At the end: whatever was held back."""
        if self.stopped:
            return ""
        searched = len(self._held)
        self._held += self._detokenizer.flush()
        at = self._find_stop(searched)
        if at is not None:
            self.stopped = True
        piece, self._held = self._held[:at], ""
        return self._take(piece)

    def _find_stop(self, searched: int) -> int | None:
        """Where the held text is cut: before the stop string that ends first (then starts
        first), looking only where one could end past ``searched``."""
        hits = []
        for s in self.stop:
            at = self._held.find(s, max(0, searched - len(s) + 1))
            if at >= 0:
                hits.append((at + len(s), at))
        return min(hits)[1] if hits else None

    def _stop_prefix_length(self) -> int:
        """How many characters at the end of the held text could grow into a stop string."""
        held, longest = self._held, 0
        for s in self.stop:
            start = held.find(s[0], max(0, len(held) - len(s) + 1))
            while start >= 0 and len(held) - start > longest:
                if s.startswith(held[start:]):
                    longest = len(held) - start
                    break
                start = held.find(s[0], start + 1)
        return longest

    def _take(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
