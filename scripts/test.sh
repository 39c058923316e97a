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
# The kernel tests set TRITON_INTERPRET=1 themselves when there is no GPU (Triton's interpreter
# runs the kernels on CPU tensors); setting it here would slow a GPU machine's serving path.
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
