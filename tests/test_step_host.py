"""The step's host-side shortcuts give exactly what the slow way gives: the stopping check reads
transformers' EOS and max-length criteria off the token and length as the criteria themselves
would decide (the greedy choices' shortcuts are tested in test_choices.py)."""

import pytest
import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from lookahead.assembly import new_sequence
from lookahead.config import LookaheadConfig
from lookahead.stopping import StopCheck


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
    check = StopCheck(criteria)
    gen = torch.Generator().manual_seed(len(criteria))
    cfg = LookaheadConfig(0, 3, 2)
    for _ in range(40):
        prompt = torch.randint(0, 12, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        seq = new_sequence(cfg, 0, torch.tensor([prompt]), prompt, 64)
        for token in torch.randint(0, 12, (14,), generator=gen).tolist():
            seq.committed.append(token)
            assert check(seq, token, None) == bool(criteria(seq.ids, None)[0]), (criteria, seq.committed)
