#!/usr/bin/env bash
# Build arctic-inference (vLLM's suffix decoding lives in its C++ extension) and install it, without
# its dependencies, into the vLLM environment given as $1 (default .venv-vllm). Safe to run again.
#
# Its build imports torch (for CMake's paths) and needs nanobind, CMake, Ninja and grpcio-tools. A
# build with pip's isolation would fetch a torch of its own (a CUDA build of several GB), so it is
# built without isolation in a throwaway environment that sees the vLLM environment's torch through
# a .pth file, after its own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VERSION=0.3.0
PYTHON=${PYTHON:-python3}
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('arctic-inference') != '$VERSION')" 2>/dev/null; then
  exit 0
fi
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
"$PYTHON" -m venv "$BUILD/env"
pip() { "$BUILD/env/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install setuptools wheel ninja cmake "nanobind==2.9.2" "protobuf==5.29.6" grpcio-tools
# then the vLLM environment's packages (torch), after the build environment's own
"$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
  > "$("$BUILD/env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/vllm-env.pth"
# CMake looks for Python on PATH: the build environment's, which has nanobind
PATH="$BUILD/env/bin:$PATH" pip wheel --no-build-isolation --no-deps -w "$BUILD/wheels" "arctic-inference==$VERSION"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps "$BUILD"/wheels/arctic_inference-*.whl
echo "arctic-inference $VERSION built and installed in $VENV" >&2
