"""The model's greedy choices at a step's kept slots (lookahead.choices): the chunked argmax
equals torch's, lazy and eager choices agree everywhere, the lazy path computes exactly the slots
that verification and the tuner read, and the engine's output is the same either way; in eager
mode (an accelerator's) a greedy step reads the device once."""

import pytest
import torch
from tiny_models import repetitive_prompt, tiny_model

from lookahead import LookaheadConfig, LookaheadStats
from lookahead.assembly import make_chooser, new_sequence
from lookahead.choices import StepChoices, fetch_matched, greedy_choices
from lookahead.emission import Emitter
from lookahead.engine import Engine
from lookahead.layout import build_layout, tree_shape
from lookahead.step import Scorer
from lookahead.support import check_model
from lookahead.tuning import match_lengths
from lookahead.verify import verify_choices


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
    rows = torch.tensor([20, 0, 9, 8, 0])  # rows of the flattened [B * K, V], repeats included
    assert torch.equal(greedy_choices(logits, rows), logits.reshape(-1, vocab)[rows].argmax(dim=-1))
    lazy, eager = StepChoices(logits, lazy=True), StepChoices(logits, lazy=False)
    lazy.fetch([(2, 1), (0, 4), (2, 1)])  # a batch of pairs, repeats included
    table = logits.argmax(dim=-1).tolist()
    assert all(lazy.get(b, k) == eager.get(b, k) == table[b][k] for b in range(3) for k in range(7))


def planted_logits(layout, first: int, after: dict, vocab=50):
    """Logits [1, K, V] where t's choice is ``first`` and the choice after token j of candidate k
    is ``after[(k, j)]`` (token 0 at every other kept slot)."""
    logits = torch.zeros(1, len(layout.logit_slots), vocab)
    logits[0, layout.logit_index[layout.t_slot], first] = 1.0
    for (k, j), token in after.items():
        logits[0, layout.logit_index[layout.candidate_slots[k][j]], token] = 1.0
    return logits


@pytest.mark.parametrize("tree", [False, True])
def test_lazy_choices_compute_exactly_what_verification_and_match_lengths_read(tree):
    # t's choice 5; candidate 0 = (5, 9, 2): the model agrees with 5, then chooses 9, then 4
    # (rejecting 2); candidate 1 = (5, 6, 1): agrees with 5, then reads candidate 0's choice after
    # 5 (the same context; its own slot, planted to say 6, is never read): rejected at 6;
    # candidate 2 = (7, 3, 3): rejected at once. W=3, one level.
    candidates = [(5, 9, 2), (5, 6, 1), (7, 3, 3)]
    if tree:
        layout = build_layout(1, 3, 1, shape=tree_shape(candidates))
    else:
        layout = build_layout(1, 3, 1, 3, 3)
    after = {(0, 0): 9, (0, 1): 4} if tree else {(0, 0): 9, (1, 0): 6, (0, 1): 4}  # a tree shares the 5
    logits = planted_logits(layout, 5, after)
    choices = StepChoices(logits, lazy=True)
    fetch_matched(choices, layout, [candidates])
    # t + the last level (t and 2 level-0 slots: t counted once) + candidate 0's slots of 5 and
    # 9; never 2, 6, 1, 7 or 3, nor candidate 1's 5 (a slot of its own when not a tree)
    assert choices.computed == 3 + 1 + 1
    computed = choices.computed
    scorer = Scorer(logits[0], layout, None, torch.tensor([[1, 2]]), candidates, choices=choices.sequence(0))
    verdict = verify_choices(scorer.choice(layout.t_slot), candidates, scorer.candidate_choice)
    lengths = match_lengths(candidates, scorer.raw_choice(layout.t_slot), scorer.raw_candidate_choice)
    window = [scorer.raw_choice(s) for s in layout.last_level_slots]
    assert verdict.emitted == (5, 9, 4) and lengths == [2, 1, 0] and window[0] == 5
    assert choices.computed == computed  # nothing read that was not fetched up front
    eager = StepChoices(logits, lazy=False)
    assert [eager.get(0, k) for k in range(len(layout.logit_slots))] == [
        choices.get(0, k) for k in range(len(layout.logit_slots))
    ]


class CountReads(torch.Tensor):
    """A tensor that counts the reads that would synchronise with an accelerator."""

    reads = 0
    SYNCING = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.SYNCING:
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def run(model, cfg, prompts, lazy, count=False):
    spec = check_model(model)
    stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.ngram_size)
    engine = Engine(model, cfg, spec, make_chooser(model, cfg, spec, len(prompts)), Emitter(), stats)
    engine.lazy_choices = lazy
    if count:
        step = engine.runner.step
        engine.runner.step = lambda *a: step(*a).as_subclass(CountReads)
    seqs = [new_sequence(cfg, b, torch.tensor([p]), p, len(p) + 30) for b, p in enumerate(prompts)]
    engine.admit(seqs, prompts)
    CountReads.reads = 0
    while engine.active:
        engine.step()
    return [s.committed for s in seqs], stats, CountReads.reads


@pytest.mark.parametrize("setting", [(4, 4, 4), (0, 4, 4), (3, 3, 2)])
def test_lazy_and_eager_choices_give_the_same_steps_and_one_read_per_eager_step(setting):
    model = tiny_model("llama")
    prompts = [repetitive_prompt(n, seed)[0].tolist() for seed, n in enumerate((24, 9, 17))]
    cfg = LookaheadConfig(*setting)
    lazy, lazy_stats, _ = run(model, cfg, prompts, lazy=True)
    eager, eager_stats, reads = run(model, cfg, prompts, lazy=False, count=True)
    assert lazy == eager and lazy_stats.accepted_hist == eager_stats.accepted_hist
    assert sum(eager_stats.accepted_hist[1:]) > 0  # multi-token steps happened
    assert reads == eager_stats.steps - 1  # the prefill's read is not counted: one per step


def test_match_lengths_read_the_first_candidate_with_the_agreed_prefix():
    # after t the model chose 5; after candidate 0's 5 it chose 9 (candidate 0 is one token long,
    # but its slot is the one verification reads for the bonus token); candidate 1's own slot of 5
    # says 6, and is never read: candidate 1 = (5, 9, 3) agrees through 9
    reads = []

    def choice(k, j):
        reads.append((k, j))
        return {(0, 0): 9, (1, 0): 6, (1, 1): 4}[(k, j)]

    assert match_lengths([(5,), (5, 9, 3), (7,)], 5, choice) == [1, 2, 0]
    assert reads == [(0, 0), (1, 1)]
    assert verify_choices(5, [(5,), (5, 9, 3)], choice).emitted == (5, 9, 4)
