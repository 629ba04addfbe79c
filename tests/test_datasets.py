"""The benchmark prompts: which of a dataset's prompts ``--n`` takes, and the modules' examples."""

import doctest
import json

import pytest

from lookahead import beam_drafts, datasets, lookup, pool


def test_a_few_prompts_are_taken_across_kinds_in_turn():
    prompts = [datasets.Prompt(f"p{i}", "", False, kind) for i, kind in enumerate("aaaabbc")]
    assert [p.id for p in datasets.spread(prompts, 5)] == ["p0", "p4", "p6", "p1", "p5"]
    every = datasets.spread(prompts, 9)
    assert [p.id for p in every] == ["p0", "p4", "p6", "p1", "p5", "p2", "p3"]
    assert all(datasets.spread(prompts, n) == every[:n] for n in range(9))  # a larger n only adds prompts
    assert datasets.spread(prompts, None) == prompts  # no n: all of them, in file order
    assert datasets.spread([], 3) == []


def test_mtbench_twenty_covers_every_category():
    """MT-bench's file lists ten questions per category, category after category: its first 20 are
    all writing and roleplay. Twenty taken across kinds have three of four categories and two of the other four."""
    twenty = datasets.mtbench(20)
    counts = {}
    for prompt in twenty:
        counts[prompt.kind] = counts.get(prompt.kind, 0) + 1
    assert set(counts) == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert sorted(counts.values()) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert [p.id for p in twenty[:3]] == ["mtbench/81", "mtbench/91", "mtbench/101"]
    assert len({p.id for p in twenty}) == 20 and all(p.chat for p in twenty)
    everything = datasets.mtbench()
    assert len(everything) == 80 and everything[0].id == "mtbench/81" and everything[-1].id == "mtbench/160"


def test_humaneval_is_one_kind_in_file_order():
    prompts = datasets.humaneval(3)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert {p.kind for p in prompts} == {"code"} and not any(p.chat for p in prompts)


def test_a_users_file_gives_kinds_and_ids(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": "a1", "kind": "a"}, {"prompt": "a2", "kind": "a"}, {"prompt": "b1", "kind": "b", "id": "B"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [(p.id, p.kind) for p in datasets.load(str(path), 2)] == [("mine/0", "a"), ("B", "b")]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match='with a "prompt" field'):
        datasets.load(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("module", [datasets, lookup, pool, beam_drafts], ids=lambda m: m.__name__)
def test_the_examples_in_docstrings_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "lines,match",
    [
        (['{"prompt": "a", "id": "p"}', '{"prompt": "b", "id": "p"}'], r"x.jsonl:2: the id 'p' is already on line 1"),
        (['{"prompt": "a"}', '"just a string"'], r"x.jsonl:2: each line needs a JSON object"),
        (['{"prompt": "a"}', "", '{"prompt": "b" "id": 3}'], r"x.jsonl:3: not JSON"),
        (['{"prompt": 5}'], r'x.jsonl:1: "prompt" must be a non-empty string'),
        (["", "  "], r"x.jsonl: no prompts"),
    ],
)
def test_a_users_file_is_checked_line_by_line_before_any_model_loads(tmp_path, lines, match):
    """Duplicate ids would merge two prompts in the report (runs are keyed by id); every other
    fault is named with its file and line."""
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        datasets.load(str(path))
