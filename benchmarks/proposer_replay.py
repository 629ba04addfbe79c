"""How many tokens per step would vLLM emit with a proposer, and at what modeled speed? The vLLM
proposers replayed over greedy texts, one request at a time, with no vLLM and no clock.

Each text (prompt + greedy output, made once by ``draft_replay.greedy_texts``) is decoded again
step by step: the proposer drafts, the step accepts the draft's longest prefix that the text goes
on with, then one more token (greedy verification), and the proposer is told what the step
emitted, as vLLM tells it. Requests come one after another, as from one client, so a warm pool
holds the earlier ones. A step is priced by a linear model of vLLM's step, ``--step-ms`` for a
plain step plus ``--token-ms`` per drafted token (fp32 SmolLM2 on the 2-core AVX2-only CPU:
about 48 and 5, docs/journal.md); lookahead's proposer learns those costs through its clock,
which the replay advances by each step's modeled time.

Proposers: ``lookahead`` (``lookahead.proposer.ChainProposer``, ``--k`` tokens at most, options as
JSON with ``--options``) and ``suffix`` (arctic-inference's ``SuffixDecodingCache``, driven as
vLLM 0.32's suffix proposer drives it, with vLLM's defaults; needs ``arctic-inference``).

    .venv-vllm/bin/python benchmarks/proposer_replay.py --texts results/greedy-texts-smollm2-float32-20x256.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _switch import SUFFIX

from lookahead.proposer import ChainProposer, ProposerOptions


class Clock:
    """The replay's time: advanced by each step's modeled seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def accepted(draft: list[int], rest: list[int]) -> int:
    """How many of the draft's tokens greedy verification accepts against the text's ``rest``."""
    n = 0
    while n < len(draft) and n < len(rest) - 1 and draft[n] == rest[n]:
        n += 1
    return n


class LookaheadDrafts:
    def __init__(self, k: int, options: dict, clock: Clock) -> None:
        self.core = ChainProposer(k, 4096, ProposerOptions.from_mapping(options), clock=clock)

    def start(self, request: int, prompt: list[int]) -> None:
        pass

    def propose(self, request: int, emitted: list[int], text: list[int]) -> list[int]:
        return self.core.propose([emitted], [text])[0]

    def stop(self, request: int) -> None:
        pass


class SuffixDrafts:
    """Arctic-inference's cache with vLLM 0.32's suffix defaults (tree depth 24, factor 1.0,
    min token probability 0.1, 24 tokens at most)."""

    def __init__(self, k: int | None) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.k, self.depth = k or SUFFIX["depth"], SUFFIX["depth"]
        self.cache = SuffixDecodingCache(max_tree_depth=self.depth, max_cached_requests=SUFFIX["cached"])

    def start(self, request: int, prompt: list[int]) -> None:
        self.cache.start_request(request, prompt)

    def propose(self, request: int, emitted: list[int], text: list[int]) -> list[int]:
        self.cache.add_active_response(request, emitted)
        pattern = text[-self.depth :]
        draft = self.cache.speculate(
            request,
            pattern,
            max_spec_tokens=self.k,
            max_spec_factor=SUFFIX["factor"],
            min_token_prob=SUFFIX["min_prob"],
        )
        return list(draft.token_ids)

    def stop(self, request: int) -> None:
        self.cache.stop_request(request)


class NgramDrafts:
    """vLLM's ``ngram`` proposer (its matcher, with its defaults: a 5-token match, k tokens)."""

    def __init__(self, k: int) -> None:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self.k, self.find = k, _find_longest_matched_ngram_and_propose_tokens

    def start(self, request: int, prompt: list[int]) -> None:
        pass

    def propose(self, request: int, emitted: list[int], text: list[int]) -> list[int]:
        return [int(t) for t in self.find(np.array(text, dtype=np.int32), 5, 5, 1 << 20, self.k)]

    def stop(self, request: int) -> None:
        pass


def replay(drafts, rows: list[dict], clock: Clock, step_ms) -> dict:
    """Decode every row's text again, one request after another; totals over all of them."""
    tokens = steps = drafted_steps = draft_tokens = accepted_tokens = 0
    seconds = 0.0
    for request, row in enumerate(rows):
        prompt, output = list(row["ids"]), list(row["output"])
        drafts.start(request, prompt)
        done, emitted = 1, output[:1]  # the prefill's token
        while done < len(output):
            draft = drafts.propose(request, emitted, prompt + output[:done])
            step = step_ms(len(draft)) / 1000
            clock.now += step
            seconds += step
            n = accepted(draft, output[done:])
            emitted = output[done : done + n + 1]
            done += len(emitted)
            tokens, steps = tokens + len(emitted), steps + 1
            drafted_steps += bool(draft)
            draft_tokens, accepted_tokens = draft_tokens + len(draft), accepted_tokens + n
        drafts.stop(request)
        clock.now += 1.0  # the next request's prefill: no step of this one's
    return {
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 3),
        "drafted_share": round(drafted_steps / steps, 3),
        "mean_draft": round(draft_tokens / max(1, drafted_steps), 2),
        "acceptance": round(accepted_tokens / max(1, draft_tokens), 3),
        "modeled_speedup": round(tokens * step_ms(0) / 1000 / seconds, 3),
    }


def step_model(args):
    """Milliseconds of a step by its drafted tokens: linear, or through the measured points."""
    if not args.step_costs:
        return lambda drafted: args.step_ms + args.token_ms * drafted
    points = sorted((int(k), float(v)) for k, v in json.loads(args.step_costs).items())
    xs, ys = [x for x, _ in points], [y for _, y in points]

    def ms(drafted: int) -> float:
        if drafted >= xs[-1] and len(xs) > 1:
            return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (drafted - xs[-1])
        return float(np.interp(drafted, xs, ys))

    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", required=True, help="greedy texts (draft_replay.greedy_texts' file)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--proposers", nargs="+", default=["lookahead", "suffix"], choices=["lookahead", "suffix", "ngram"])
    p.add_argument("--k", type=int, default=16, help="lookahead's most draft tokens")
    p.add_argument("--ngram-k", type=int, default=7, help="ngram's draft tokens")
    p.add_argument("--suffix-k", type=int, help="suffix's most draft tokens (default 24)")
    p.add_argument("--options", nargs="+", default=["{}"], help="lookahead's options, JSON, one replay each")
    p.add_argument("--step-ms", type=float, default=48.0)
    p.add_argument("--token-ms", type=float, default=5.0)
    p.add_argument(
        "--step-costs",
        help='measured step times instead, JSON {"drafted tokens": ms, ...}: linear between them, and beyond',
    )
    args = p.parse_args()
    every = json.loads(Path(args.texts).read_text())
    step_ms = step_model(args)
    for dataset in args.datasets:
        rows = [r for r in every if r["dataset"] == dataset]
        for proposer in args.proposers:
            for options in args.options if proposer == "lookahead" else [None]:
                clock = Clock()
                if proposer == "lookahead":
                    drafts = LookaheadDrafts(args.k, json.loads(options), clock)
                else:
                    drafts = SuffixDrafts(args.suffix_k) if proposer == "suffix" else NgramDrafts(args.ngram_k)
                result = replay(drafts, rows, clock, step_ms)
                name = proposer + (f" {options}" if options and options != "{}" else "")
                print(json.dumps({"dataset": dataset, "proposer": name, **result}), flush=True)


if __name__ == "__main__":
    main()
