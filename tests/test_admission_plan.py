"""Which queued requests a server step prefills: within the prefill budget, in the queue's order."""

from collections import deque
from types import SimpleNamespace

from lookahead.admission_plan import plan_step, plan_whole


def queue(*lengths):
    return deque(SimpleNamespace(prompt_ids=[1] * n, name=i) for i, n in enumerate(lengths))


def names(requests):
    return [r.name for r in requests]


def test_newcomers_fit_the_budget_padded_to_the_longest_and_a_long_prompt_starts_in_what_is_left():
    pending = queue(3, 3, 10, 1)
    plan = plan_step(pending, room=8, prefill_chunk=8, under_way=None)
    assert names(plan.newcomers) == [0, 1]  # 2 x 3 tokens; a third would pad all three to 10
    assert plan.chunk == 0 and plan.start[0].name == 2 and plan.start[1] == 2  # its first 2 tokens
    assert names(pending) == [3]  # the queue's order: the short one behind waits
    assert names(plan_step(queue(4, 4), room=8, prefill_chunk=8, under_way=None).newcomers) == [0, 1]  # exactly


def test_the_long_prompt_under_way_comes_first_and_only_one_is_under_way():
    pending = queue(2, 20)
    plan = plan_step(pending, room=8, prefill_chunk=8, under_way=5)
    assert plan.chunk == 5 and names(plan.newcomers) == [0] and plan.start is None
    assert names(pending) == [1]
    assert plan_step(queue(4), room=8, prefill_chunk=8, under_way=30).newcomers == []  # the chunk takes it all


def test_room_in_the_batch_bounds_newcomers():
    pending = queue(1, 1, 1)
    assert names(plan_step(pending, room=2, prefill_chunk=64, under_way=None).newcomers) == [0, 1]
    assert plan_step(queue(1), room=1, prefill_chunk=64, under_way=3).newcomers == []  # the one under way holds it


def test_a_vision_language_model_takes_whole_prompts_and_always_the_first():
    assert names(plan_whole(queue(100, 1), room=8, prefill_chunk=8).newcomers) == [0]
    assert names(plan_whole(queue(3, 4, 2), room=8, prefill_chunk=8).newcomers) == [0, 1]
    assert names(plan_whole(queue(1, 1, 1), room=2, prefill_chunk=8).newcomers) == [0, 1]
