#!/usr/bin/env bash
# Everything a GPU session checks and measures for the kernels, in one call of the device
# tool (`bash benchmarks/gpu_session.sh`, run from the repository root; logs and JSON land
# in $OUT). It needs only jax, numpy and pytest, which the GPU image has.
#
#   1. the machine: GPU, clocks, jax and jaxlib versions;
#   2. the kernels compiled on the GPU against their references, and the cuDNN attention
#      path (tests/test_gpu.py and tests/test_flash_attention.py with MESHLM_TEST_GPU=1);
#   3. benchmarks.attention (8K/16K/64K, MHA and GQA; ours vs cuDNN vs XLA) and
#      benchmarks.paged_decode (8x4K .. 256x8K vs the copy bandwidth).
#
# Stage 3 runs even if stage 2 fails, so that one call gives both the failures and the
# speed. Each stage has a time limit that keeps the whole call under the tool's 10 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/meshlm_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

stage() {  # stage NAME SECONDS COMMAND...: runs it with a limit, log in $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}

stage machine 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,\
driver_version --format=csv; $PY -c 'import jax, jaxlib; print(\"jax\", jax.__version__, \
\"jaxlib\", jaxlib.__version__, jax.devices())'"
stage tests "${TEST_LIMIT:-180}" env MESHLM_TEST_GPU=1 "$PY" -m pytest -rs -x \
  tests/test_gpu.py tests/test_flash_attention.py
stage attention "${ATTENTION_LIMIT:-240}" "$PY" -m benchmarks.attention
stage paged_decode "${PAGED_LIMIT:-90}" "$PY" -m benchmarks.paged_decode
cp benchmarks/results/attention_*.json benchmarks/results/paged_decode_*.json "$OUT/" \
  2>/dev/null
ls "$OUT"
