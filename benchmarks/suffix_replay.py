"""SuffixDecoding (arctic-inference's C++ suffix tree) replayed over the same greedy texts and cost
curves as ``draft_replay.py``, so that its drafts and ours are judged alike (issue 14).

Each step asks the request's suffix tree (its prompt and what it has emitted so far; no cache of
other requests, as ``Lookahead()`` in ``generate`` has none) for a draft, walks the draft along the
greedy text (the tokens the model would accept), emits those and the bonus token, and prices the
step as ``draft_replay.py`` does: T(1 + drafted tokens) / T(1) on the cost curve. The modeled
speedup of a prompt is its output length (less the prefill's token) over that cost.

arctic-inference is not a dependency. It ships as a source package whose isolated build asks for
torch>=2.10 from PyPI (the multi-GB CUDA build), and its CMake file finds the system Python rather
than a virtual environment's, so it builds only by hand, in a scratch environment::

    python3 -m venv /tmp/arctic/venv
    /tmp/arctic/venv/bin/pip install torch==2.13.0 numpy cmake ninja nanobind==2.9.2 \\
        protobuf==5.29.6 grpcio-tools setuptools wheel
    CMAKE_ARGS="-DPython_EXECUTABLE=/tmp/arctic/venv/bin/python" /tmp/arctic/venv/bin/pip install \\
        --no-build-isolation --no-deps arctic-inference==0.3.0

then (the texts are ``draft_replay.py``'s, made by its first run)::

    .venv/bin/python benchmarks/suffix_replay.py --site /tmp/arctic/venv/lib/python3.11/site-packages \\
        --curves stored mid
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import policy_share  # noqa: E402  (the cost curves)


def replay(cache_type, row: dict, curve, cap: int, min_prob: float, tree: bool) -> float:
    """One prompt's modeled speedup under SuffixDecoding's drafts."""
    cache = cache_type(max_tree_depth=64, max_cached_requests=0)
    prompt, text = row["ids"], row["output"]
    cache.start_request(0, prompt)
    committed = [*prompt, text[0]]  # the prefill gives the first token
    cache.add_active_response(0, text[:1])
    cost, p = 0.0, 1
    while p < len(text):
        room = len(text) - p - 1  # tokens a draft could still be right about, before the bonus
        draft = cache.speculate(
            0, committed[-64:], max_spec_tokens=min(cap, room), min_token_prob=min_prob, use_tree_spec=tree
        ) if room > 0 else None  # fmt: skip
        tokens, parents = (draft.token_ids, draft.parents) if draft is not None else ([], [])
        accepted, node = 0, -1  # walk the draft tree along the text (node -1: the root)
        while p + accepted < len(text):
            pairs = enumerate(zip(tokens, parents, strict=True))
            node = next((i for i, (t, up) in pairs if up == node and t == text[p + accepted]), None)
            if node is None:
                break
            accepted += 1
        emitted = text[p : p + accepted + 1]
        cost += curve.ratio(1 + len(tokens), 1)
        committed += emitted
        cache.add_active_response(0, emitted)
        p += len(emitted)
    return (len(text) - 1) / cost if cost else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", required=True, help="site-packages of the environment arctic-inference was built in")
    parser.add_argument("--texts", default="results/greedy-texts-smollm2-bfloat16-20x256.json")
    parser.add_argument("--model", default="smollm2", help="whose stored cost curve 'stored' means")
    parser.add_argument("--curves", nargs="+", default=["stored"])
    parser.add_argument("--caps", type=int, nargs="+", default=[7, 16], help="max_spec_tokens")
    parser.add_argument("--min-probs", type=float, nargs="+", default=[0.1, 0.3, 0.6], help="min_token_prob")
    parser.add_argument("--json", help="write every prompt's result here")
    args = parser.parse_args()
    sys.path.append(args.site)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rows = json.loads(Path(args.texts).read_text())
    names = list(dict.fromkeys(r["dataset"] for r in rows))
    print("| curve | max_spec_tokens | min_token_prob | tree | " + " | ".join(f"{n} (median)" for n in names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    results = []
    for curve_name in args.curves:
        curve = policy_share.load_curve(curve_name, args.model)
        for cap, min_prob, tree in itertools.product(args.caps, args.min_probs, [False, True]):
            speedups = {n: [] for n in names}
            for row in rows:
                speedups[row["dataset"]].append(replay(SuffixDecodingCache, row, curve, cap, min_prob, tree))
            medians = {n: statistics.median(v) for n, v in speedups.items()}
            print(f"| {curve_name} | {cap} | {min_prob} | {tree} | "
                  + " | ".join(f"{medians[n]:.3f}x" for n in names) + " |", flush=True)  # fmt: skip
            results.append({"curve": curve_name, "max_spec_tokens": cap, "min_token_prob": min_prob, "tree": tree,
                            "medians": medians, "speedups": speedups})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
