#!/usr/bin/env bash
# Set up, then start Kafka and the four services with the default model (weir up); Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec weir up "$@"
