#!/usr/bin/env bash
# Set up, start the local Kafka broker if none runs, run the whole test suite, stop what it started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
started=0
if ! weir kafka status >/dev/null 2>&1; then
  weir kafka up
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then weir kafka down || true; fi; }
trap cleanup EXIT
# The SBOM of what was just installed and resolved, checked against the locks and the jar pins
# (docs/supply-chain.md); tests/test_supply_chain.py checks the document against the schema. The
# jars are resolved here even when a broker was already running (it may be another $WEIR_HOME's);
# when they are, this only checks them against jars.sha256.
python -c "from weir.kafka import launcher; launcher.resolve_jars()"
weir sbom --out var/sbom.cdx.json --check
# Lint, format and types before any test (pyproject.toml's [tool.ruff] and [tool.mypy]): code a tool
# would reformat or flag is not done. `ruff format` rewrites what --check reports; `ruff check --fix`
# fixes the safe findings.
ruff check --no-cache .
ruff format --no-cache --check .
mypy
# The kernel tests set TRITON_INTERPRET=1 themselves when there is no GPU (Triton's interpreter
# runs the kernels on CPU tensors); setting it here would slow a GPU machine's serving path.
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
