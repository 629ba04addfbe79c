"""The sequences of a batch: what each one has committed, its pool, window and own settings.

Words: a *sequence* is one member of the batch (one prompt and its output). Planning a step over
the sequences is ``lookahead.planning``; appending what a step verified, ``lookahead.emission``;
the ``generate`` output, ``lookahead.output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .lookup import ContextIndex
from .pool import NGramPool, SharedPool
from .stopping import StopCheck
from .window import JacobiWindow


@dataclass
class SeqState:
    """One sequence of the batch, with its own generation settings."""

    index: int  # position in the caller's batch (processors built for a batch see it there)
    prompt_ids: torch.Tensor  # [1, S]: the caller's prompt, padding kept
    committed: list[int]  # the prompt without padding, then every emitted token
    pool: NGramPool
    window: JacobiWindow
    max_length: int  # len(ids) at which the sequence ends
    processors: object = None  # LogitsProcessorList or None (greedy argmax of the raw logits)
    criteria: object = None  # StoppingCriteriaList called with (ids [1, S], scores)
    seed: int | None = None  # sampling: draws from noise keyed by (seed, position) (see verify.position_noise)
    batch_size: int = 1  # size of the batch the processors were built for
    max_candidates: int | None = None  # this sequence's own cap on G (None: the engine's)
    ngram_size: int | None = None  # this sequence's own cap on N
    context: ContextIndex | None = None  # longest-suffix lookup over the committed text
    shared: SharedPool | None = None  # n-grams of earlier sequences (a server's warm pool)
    carry: tuple[int, ...] = ()  # verified tokens after t that could not be committed yet
    candidates: list[tuple[int, ...]] = field(default_factory=list)  # this step's
    stopped_at: int | None = None  # len(ids) when a stopping criterion first fired
    steps: int = 0  # forward passes this sequence took part in (its prefill included)
    finished: bool = False  # left the batch
    cancelled: bool = False  # asked to leave at the next step boundary
    # when recording: the candidates at hand at each step, by the output position the step starts
    # at (what lookahead.bound's clairvoyant policy may pick from besides the text's own suffixes)
    trace: dict[int, list[tuple[int, ...]]] | None = None
    stop_check: StopCheck | None = field(default=None, repr=False)  # built from ``criteria`` (Emitter)

    @property
    def t(self) -> int:
        return self.committed[-1]

    def __post_init__(self) -> None:
        self.start_length = self.prompt_ids.shape[1]
        self._prompt_tokens = len(self.committed)
        self._ids = self.prompt_ids

    @property
    def length(self) -> int:
        """len(ids): the caller's prompt (padding kept) and every emitted token."""
        return self.start_length + len(self.committed) - self._prompt_tokens

    @property
    def ids(self) -> torch.Tensor:  # [1, length]
        """The prompt and every emitted token as a tensor, for processors, criteria and the output;
        built when read (emitting a token only appends it to ``committed``)."""
        missing = self.length - self._ids.shape[1]
        if missing:
            new = torch.tensor([self.committed[-missing:]], dtype=self._ids.dtype)  # on the host, sent without a wait
            self._ids = torch.cat([self._ids, new.to(self._ids.device, non_blocking=True)], dim=-1)
        return self._ids

    @property
    def new_tokens(self) -> int:
        return self.length - self.start_length

    def match_length(self) -> int | None:
        """The longest suffix of the text seen earlier, in its own text or an earlier sequence's."""
        own = self.context.match_length(self.committed) if self.context is not None else None
        if self.shared is None:
            return own
        return max(own or 0, self.shared.match_length(self.committed))
