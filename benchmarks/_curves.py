"""The cost curves ``draft_replay.py`` prices its replays with: named shapes of machine, or the
curve this machine stored for a model. Not a tool itself.

Named curves, T(k)/T(1) at k = 1, 2, 4, 8, 16, 32: ``steep`` (a slow 2-core CPU in bf16: 2.25,
3.0, 4.8, 7.6 for k = 2, 4, 8, 16, measured 2026-12-02), ``flat`` (a faster one: 1.23, 1.68,
1.68, 2.14, measured 2026-12-01), ``mid`` (1.44, 2.04, 3.32, 5.82, stored here 2026-12-02) and
``gpu`` (nearly free width: 1.02, 1.04, 1.08, 1.15). ``steep``, ``flat`` and ``mid`` were curves
stored on other CPUs before 2026-12-04, probably timed with autograd on (the calibration had it on
when `lookahead bench` asked for a curve, until 2026-12-04), so read them as modeled machines of
those shapes, not as those machines: this one's bf16 curve without autograd was 1.03, 1.09, 1.15,
1.33 on 2026-12-04 and 1.07, 1.09, 1.12, 1.17 on 2026-12-05 (``stored``). ``stored-float16`` and
``stored-float32`` are this machine's curves in those dtypes, timed the current way: real
configurations of other shapes (here, 2026-12-05: fp16 about 1.37, 1.42, 1.6, 1.8, a dear first
draft token and nearly free ones after it; fp32 about 1.08, 1.50, 1.84, 2.01).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lookahead import costs, models

CURVES = {  # T(k)/T(1) at k = 1, 2, 4, 8, 16, 32
    "steep": ((1, 1.0), (2, 2.25), (4, 3.02), (8, 4.77), (16, 7.65), (32, 14.8)),
    "flat": ((1, 1.0), (2, 1.23), (4, 1.68), (8, 1.68), (16, 2.14), (32, 4.0)),
    # this machine's stored bf16 curve of 2026-12-02 (later), between steep and flat
    "mid": ((1, 1.0), (2, 1.44), (4, 2.04), (8, 3.32), (16, 5.82), (32, 11.0)),
    "gpu": ((1, 1.0), (2, 1.02), (4, 1.04), (8, 1.08), (16, 1.15), (32, 1.3)),
}


def load_curve(name: str, model_name: str) -> costs.CostCurve:
    """A named curve (``CURVES``), or ``stored`` / ``stored-DTYPE``: the curve this machine
    stored for the model in bf16 / in DTYPE (``stored-float16``, ``stored-float32``), or a JSON
    file of [tokens, seconds] points."""
    if name.endswith(".json"):
        return costs.CostCurve.from_points(json.loads(Path(name).read_text()))
    if name == "stored" or name.startswith("stored-"):
        try:
            dtype = str(models.parse_dtype(name.partition("-")[2] or "bfloat16")).replace("torch.", "")
        except ValueError as err:
            raise SystemExit(f"curve {name!r}: {err}") from None
        return stored_curve(model_name, dtype)
    if name not in CURVES:
        raise SystemExit(f"unknown curve {name!r}: one of {', '.join(CURVES)}, stored or stored-DTYPE")
    return costs.CostCurve(CURVES[name])


def stored_curve(model_name: str, dtype: str = "bfloat16") -> costs.CostCurve:
    """The curve ``Lookahead()`` stored for the model in ``dtype`` on this machine, timed the
    current way (``costs.CALIBRATION``), at this process's thread count where one was stored at
    it; any run of the model in that dtype stores one (``lookahead bench --dtype ...``)."""
    hint = f"run `lookahead bench humaneval --n 1 --max-new-tokens 8 --model {model_name} --dtype {dtype}` once"
    try:
        stored = json.loads((models.cache_dir() / "cost-curves.json").read_text())
    except FileNotFoundError:
        raise SystemExit(f"no cost curve stored yet in {models.cache_dir()}: {hint}") from None
    arch = {"smollm2": "llama", "gemma3": "gemma3_text"}.get(model_name, model_name)
    mine = f"|{dtype}|", costs.CALIBRATION
    # the model's, not the tiny test models' of the same architecture (their T(1) is under 20 ms)
    keys = [k for k in stored if k.startswith(arch + "-") and all(m in k.replace("torch.", "") for m in mine)]
    keys = [k for k in keys if stored[k][0][1] > 0.02]
    if not keys:
        raise SystemExit(f"no {dtype} cost curve of {model_name} stored: {hint}")
    threads = [k for k in keys if f"|{torch.get_num_threads()}|" in k]
    if not threads:
        print(f"note: no {dtype} curve at {torch.get_num_threads()} threads; using {keys[0]}", file=sys.stderr)
    return costs.CostCurve(tuple((int(k), float(s)) for k, s in stored[(threads or keys)[0]]))
