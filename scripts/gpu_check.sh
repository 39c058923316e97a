#!/usr/bin/env bash
# On a CUDA machine: run the kernel tests compiled (no Triton interpreter), time each Triton kernel
# against its PyTorch reference (python -m bench kernels), then the engine on a 1B-class Llama
# (python -m bench gpu-llama). Not part of the test suite. Results go to $OUT if it is set, else
# /tmp/weir-gpu-check: kernel-tests.txt, kernel-tests.xml, bench.txt, bench_kernels.{json,md},
# gpu_bench_llama.{txt,json,md}, nvidia-smi.txt. Exit status: non-zero if the tests, the kernel
# bench's correctness checks or the Llama bench failed.
#   bash scripts/gpu_check.sh [--quick]     (--quick: fewer kernel bench sizes, bf16 only)
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/weir-gpu-check}"
mkdir -p "$out"

# The repo's venv where it has a CUDA torch, else the machine's python3 (e.g. a bare GPU image).
py=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  py=.venv/bin/python
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
if ! "$py" -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__); sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: $py has no CUDA device (or no torch/triton)" >&2
  exit 2
fi

"$py" -m pytest -q -p no:cacheprovider tests/kernels -rs --junitxml="$out/kernel-tests.xml" 2>&1 | tee "$out/kernel-tests.txt"
tests_rc=${PIPESTATUS[0]}

bench_args=(--out "$out")
if [ "${1:-}" = "--quick" ]; then
  bench_args+=(--quick --dtype bfloat16)
else
  bench_args+=(--dtype bfloat16 --dtype float16)
fi
"$py" -m bench kernels "${bench_args[@]}" 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}

# The engine on a 1B-class Llama (random bf16 weights): batch-1 tokens/s against the bandwidth
# bound, batch-64 throughput against transformers' generate().
"$py" -m bench gpu-llama --out "$out" 2>&1 | tee "$out/gpu_bench_llama.txt"
llama_rc=${PIPESTATUS[0]}

echo "gpu_check: kernel tests rc=$tests_rc, bench rc=$bench_rc, llama rc=$llama_rc, results in $out"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$llama_rc" = 0 ]
