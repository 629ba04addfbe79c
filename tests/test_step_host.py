"""The step's host-side shortcuts give exactly what the slow way gives: the chunked greedy choice
equals torch.argmax (ties and NaNs included), and the stopping check reads transformers' EOS and
max-length criteria off the token and length as the criteria themselves would decide."""

import pytest
import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from lookahead.decoding import new_sequence
from lookahead.config import LookaheadConfig
from lookahead.sequences import _StopCheck
from lookahead.step import greedy_choices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 1024, 1537, 49152, 50257])
def test_greedy_choices_equal_argmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(3, 7, vocab, generator=gen) * 4).to(dtype)
    # ties for the maximum: the first index must win, in the same chunk and across chunks
    top = logits.max() + 1
    logits[0, 0, [5, 6]] = top
    logits[0, 1, [vocab - 1, 3]] = top
    logits[0, 2, [vocab // 2, vocab - 1]] = top
    logits[1, 0, -1] = top  # the maximum in the last (possibly short) chunk
    logits[1, 1] = float("-inf")  # every logit -inf: index 0
    logits[1, 2, [7, vocab - 2]] = float("nan")  # NaNs count as the maximum, first one wins
    logits[2, 3] = 0.0  # all equal
    assert torch.equal(greedy_choices(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_choices(logits[0, 0]), logits[0, 0].argmax(dim=-1))


class EvenLength(StoppingCriteria):
    """A criterion the check must call: stops once the text has an even length over 12."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] > 12 and input_ids.shape[1] % 2 == 0)


@pytest.mark.parametrize(
    "criteria",
    [
        [EosTokenCriteria(eos_token_id=[3, 9])],
        [EosTokenCriteria(eos_token_id=torch.tensor(4)), MaxLengthCriteria(max_length=11)],
        [MaxLengthCriteria(max_length=15), EvenLength()],
        [EvenLength(), EosTokenCriteria(eos_token_id=2)],
    ],
)
def test_stop_check_agrees_with_criteria(criteria):
    criteria = StoppingCriteriaList(criteria)
    check = _StopCheck(criteria)
    gen = torch.Generator().manual_seed(len(criteria))
    cfg = LookaheadConfig(0, 3, 2)
    for trial in range(40):
        prompt = torch.randint(0, 12, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        seq = new_sequence(cfg, 0, torch.tensor([prompt]), prompt, 64)
        for token in torch.randint(0, 12, (14,), generator=gen).tolist():
            seq.committed.append(token)
            assert check(seq, token, None) == bool(criteria(seq.ids, None)[0]), (criteria, seq.committed)
