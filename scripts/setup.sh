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
