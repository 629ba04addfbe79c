"""A sequence's stop check: whether its stopping criteria fire after its latest token, without a
tensor per token for the criteria that can be read off the token and the length."""

from __future__ import annotations

from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


class StopCheck:
    """Whether a sequence's stopping criteria fire after its latest token. transformers' EOS and
    max-length criteria are read off the token and the length (as they compute them, without a
    tensor per token); any other criterion is called with the sequence's ids. Criteria built for a
    batch see the sequence at its own index, in a batch of copies of it (sequences of a batch
    differ in length under lookahead)."""

    def __init__(self, criteria) -> None:
        self.criteria = criteria
        self.eos: set[int] = set()
        self.max_length: int | None = None
        others = []
        for criterion in criteria:
            if type(criterion) is EosTokenCriteria:
                self.eos.update(int(t) for t in criterion.eos_token_id.reshape(-1).tolist())
            elif type(criterion) is MaxLengthCriteria:
                limit = criterion.max_length
                self.max_length = limit if self.max_length is None else min(self.max_length, limit)
            else:
                others.append(criterion)
        self.others = StoppingCriteriaList(others)

    def __call__(self, seq, token: int, scores) -> bool:
        """Whether ``seq`` (the :class:`lookahead.sequences.SeqState` that holds this check: its
        ``length``, ``ids``, ``index`` and ``batch_size`` are read) stops at ``token``, just
        appended; ``scores`` as the criteria take them (None where none were kept)."""
        if token in self.eos or self.max_length is not None and seq.length >= self.max_length:
            return True
        if not self.others:
            return False
        if seq.batch_size == 1:
            return bool(self.others(seq.ids, scores)[0])
        return bool(self.others(seq.ids.expand(seq.batch_size, -1), scores)[seq.index])
