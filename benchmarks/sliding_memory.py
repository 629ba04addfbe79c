"""Does the memory of sliding-window layers stay bounded by the window over a long generation?

Runs `Lookahead(4, 4, 4)` on a tiny random-weight Mistral (every layer slides, window 16) and
Gemma 3 text model (one sliding layer of window 8, one full-attention layer) for up to
--new-tokens new tokens, and records after every step the cache columns and key/value bytes held
by sliding and by full-attention layers; then the same with the cache handed back
(`return_dict_in_generate`), where every column is kept. Outputs are checked against
`model.generate` (fp32, greedy). Prints a row per model, length and cache choice.

    .venv/bin/python benchmarks/sliding_memory.py --new-tokens 120 480          # docs/exactness.md
    .venv/bin/python benchmarks/sliding_memory.py --new-tokens 24               # smallest: seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import CONFIGS, repetitive_prompt, tiny_model  # noqa: E402

from lookahead import Lookahead  # noqa: E402
from lookahead.support import check_model  # noqa: E402


def run(arch: str, new_tokens: int, keep_cache: bool) -> tuple[dict, bool]:
    model = tiny_model(arch)
    spec = check_model(model)
    sliding = set(spec.sliding_layers(model.config))
    prompt = repetitive_prompt(24, 4)
    peak = {"sliding columns": 0, "full columns": 0, "sliding KV bytes": 0, "full KV bytes": 0}

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None or not cache.layers or not cache.layers[0].is_initialized:
            return
        for i, layer in enumerate(cache.layers):
            kind = "sliding" if i in sliding else "full"
            peak[f"{kind} columns"] = max(peak[f"{kind} columns"], layer.keys.shape[2])
        for kind in ("sliding", "full"):
            size = sum(
                layer.keys.numel() * layer.keys.element_size() * 2
                for i, layer in enumerate(cache.layers)
                if (i in sliding) == (kind == "sliding")
            )
            peak[f"{kind} KV bytes"] = max(peak[f"{kind} KV bytes"], size)

    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)  # no early EOS
    expected = model.generate(prompt, **settings)
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = model.generate(
            prompt, custom_generate=Lookahead(4, 4, 4), return_dict_in_generate=keep_cache, **settings
        )  # fmt: skip
    finally:
        handle.remove()
    sequences = out.sequences if keep_cache else out
    return peak, sequences.tolist() == expected.tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[120, 480], help="at most 480 (512 positions)")
    args = parser.parse_args()
    print("| model (window) | new tokens | cache handed back | sliding layers: peak columns | full layers: peak "
          "columns | sliding KV peak (KiB) | identical to generate |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for arch in ("mistral", "gemma3_text"):
        window = CONFIGS[arch].get("sliding_window")
        for new in args.new_tokens:
            for keep in (False, True):
                peak, same = run(arch, new, keep)
                full = peak["full columns"] or "-"
                print(f"| {arch} ({window}) | {new} | {'yes' if keep else 'no'} | {peak['sliding columns']} | "
                      f"{full} | {peak['sliding KV bytes'] / 1024:.0f} | {'yes' if same else 'NO'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
