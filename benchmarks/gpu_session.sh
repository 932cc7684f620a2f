#!/usr/bin/env bash
# What a GPU session checks and measures for the kernels, run from the repository root by
# the device tool; logs and JSON land in $OUT. The benchmark stages attention .. packed
# need only jax and numpy, which the GPU image has; tests (the suite's conftest loads the
# serving fixtures, which import training), planner and train_* import the training
# stack (flax, optax, orbax, grain, ml_collections, rich, tensorboardX), which `machine`
# lists as found or missing: the machine has no network to install them. The image lacks
# grain, ml_collections and tensorboardX: run benchmarks/gpu_wheels.sh here first and
# name .whl in every call's carry; the wheels found there are installed into /tmp/site
# before the first stage. (Without them, on 2026-11-26, the tests stage stopped at
# collection: "No module named 'grain'".)
#
# On an H200 on 2026-11-28 (the fifth session), with .whl carried: machine, paged_decode,
# paged_splits, tests_paged, paged_step and tokamax (stopped at its 130 s limit, one
# implementation short) in one call of 322 s; planner_mid 85 s with the machine's start.
# Measured on an H200 on 2026-11-26 (the first GPU session): machine ~10 s; test_gpu.py
# alone 40 s with 8 workers; tests (both files, 4 workers) did not finish in 200 s;
# attention (four implementations, no XLA) 150 s; paged_decode 40 s; paged_tiles 70 s;
# train_64k (pallas with Triton kernels, then cudnn) 150 s; starting the machine ~30 s.
# On another H200 the same day (the third session): test_flash_attention.py alone with 8
# workers, all 63 tests, 54 s; pass_trace 60 s beside it; one train_64k run 55-75 s (the
# first on a machine also tokenizes the corpus); train_8k, two runs, 85 s; packed 70 s.
# Stages, run in the order given (default: all of them):
#
#   machine       GPU, clocks, jax and jaxlib versions                          ~10 s
#   pass_trace    benchmarks.hlo_pass_trace: gpt_64k's 64K step compiled with
#                 XLA's per-pass dump; the passes that change its kernel calls  ~1 min
#   tests         kernels compiled on the GPU against their references, and the
#                 cuDNN path (tests/test_gpu.py, tests/test_flash_attention.py)  ~3 min
#   tests_paged   the paged kernel's compiled tests only (test_gpu.py -k paged)  ~1 min
#   attention     benchmarks.attention: Triton and Mosaic GPU kernels (two-kernel
#                 and fused backward) vs cuDNN, 8K/16K/64K (ATTENTION_IMPLS)   ~3 min
#   tiles         benchmarks.attention --tiles: our tile choices at 8K          ~4 min
#   paged_decode  benchmarks.paged_decode: 8x4K .. 256x8K vs copy bandwidth     ~1 min
#   paged_splits  benchmarks.paged_decode --splits: KV splits per sequence x
#                 tiles at 1-32 sequences, each output checked                 ~3 min
#   tokamax       benchmarks.attention with tokamax's Mosaic GPU and Triton
#                 kernels beside cuDNN and ours (gpu_wheels.sh --tokamax)       ~4 min
#   paged_tiles   benchmarks.paged_decode --tiles: the kernel's tile choices    ~1 min
#   paged_step    benchmarks.paged_decode --step: a Llama-3.2-1B-shaped decode
#                 step at a full cache (64 x 8K tokens, 17 GB), the kernel
#                 reading each layer in place in the stacked cache vs a layer
#                 sliced out first: slices of a layer and copies of the cache
#                 counted in the compiled step, and its time                    ~2 min
#   packed        benchmarks.attention --packed: 8K rows of 8K/2K/512-token
#                 documents, Triton and Mosaic GPU (document block skipping)    ~3 min
#   planner       benchmarks.planner_check on default.py: the planner's top
#                 one-GPU layouts run, predicted vs measured                    ~3 min
#   planner_64k   the same for gpt_64k.py at 2 sequences of 64K a step (not its
#                 8: a quarter of the time; grad_accum 1 and 2, 3 steps each),
#                 then the efficiency fit over both configs' runs (on the
#                 GPU's jax; refit here with --fit ... --replan, whose counts
#                 the table in sharding/planner.py was fitted to). On an H200
#                 (2026-11-26): planner 60 s, planner_64k 140 s, both with
#                 machine in one call of 215 s                                 ~4 min
#   planner_mid   the same for default.py at 512 sequences a step (65,536 tokens:
#                 mostly memory-bound kernels, which the two above leave the HBM
#                 factor's fit loose on; remat none and full, grad_accum 1 and
#                 4), then the fit over every planner_check_gpu_*.json here  ~2 min
#   train_64k     benchmarks.train_throughput, gpt_64k's model on this GPU, one
#                 65,536-token sequence a step, each attention_impl:remat of
#                 TRAIN_RUNS (default pallas:save_attention pallas:full
#                 cudnn:full cudnn:save_attention; remat full if not named):
#                 tokens/s, MFU, peak memory, one step profiled (the three
#                 largest costs)                                                ~8 min
#   train_8k      the same at 8,192 tokens, 8 sequences a step                  ~6 min
#   serve         benchmarks.serve_throughput --shapes=1b: a random Llama-3.2-1B-shaped
#                 model in bfloat16, continuous batching against transformers'
#                 static batches of 64 on the same GPU, 256 requests, one pass
#                 (SERVE_REPEATS: each more ~75 s); then a float32 reference's
#                 first tokens and the engine's start again, from the
#                 compilation cache the first filled. On 2026-11-26 the stage
#                 without those two took 287 s by the device tool (warm-up
#                 135 s)                                                       ~6 min
#   quant         benchmarks.quantization --shapes=1b: the same random Llama-3.2-1B-shaped
#                 model with bfloat16, int8 and fp8 layer weights (--quantization), 64
#                 requests of 256 prompt and 128 output tokens at once: output tokens/s
#                 and greedy agreement with bfloat16 (needs qwix: gpu_wheels.sh, .whl
#                 carried; torch and transformers build the model)            ~4 min
#
# All of it is far more than the 15 minutes of device time a session has now (the
# machine's start, a few minutes, counts too): take the stages the open issues need
# first, in issue 16's order (tests, attention, paged_decode, then train_64k, serve),
# with planner and planner_64k for issue 14's fit. The serve stage also needs torch,
# transformers and tokenizers (`machine` lists them; the image has them).
#
# The device tool stops a command at 10 minutes, so split the stages over calls, made
# back to back (the machine is given back after 30 s idle), for example:
#   bash benchmarks/gpu_session.sh machine tests
#   bash benchmarks/gpu_session.sh attention
#   bash benchmarks/gpu_session.sh tiles
#   bash benchmarks/gpu_session.sh paged_decode paged_tiles packed
#   bash benchmarks/gpu_session.sh paged_step
#   bash benchmarks/gpu_session.sh planner
#   bash benchmarks/gpu_session.sh planner_64k
#   bash benchmarks/gpu_session.sh train_64k
#   bash benchmarks/gpu_session.sh train_8k
#   bash benchmarks/gpu_session.sh serve
# A failing stage does not stop the next, so one call reports both failures and speed.
# At most 8 files come back from a call: each stage's log, plus each JSON it wrote
# (train_64k: 4, and the compiled HLO of its 2 save_attention runs), so train_64k and
# train_8k go in separate calls.
# The times above are estimates, not measurements; each stage has its own time limit.
set -uo pipefail
export OUT=${OUT:-/tmp/meshlm_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then   # carried wheels (benchmarks/gpu_wheels.sh)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [[ -d /tmp/site/tokamax ]] && ! "$PY" -c 'import xprof' 2>/dev/null; then
  # tokamax imports xprof.cli.tools for its own profiling helper only (not carried: 32 MB
  # with cloud-storage clients); an empty stand-in lets `import tokamax` succeed.
  mkdir -p /tmp/stub/xprof/cli && touch /tmp/stub/xprof/__init__.py /tmp/stub/xprof/cli/__init__.py
  echo 'get_kernel_stats_tool = None' > /tmp/stub/xprof/cli/tools.py
  export PYTHONPATH="$PYTHONPATH:/tmp/stub"
fi

START=$(mktemp)   # results newer than this were written by this session

stage() {  # stage NAME SECONDS COMMAND...: runs it with a limit, log in $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}

train() {  # train SEQ BATCH: gpt_64k's model, each attention_impl:remat of TRAIN_RUNS
  local seq=$1 batch=$2 run impl remat
  # pallas is auto: the Mosaic GPU kernels on Hopper. save_attention: the backward runs no
  # attention forward (the planner predicts ~10% off a 64K step).
  for run in ${TRAIN_RUNS:-pallas:save_attention pallas:full cudnn:full cudnn:save_attention}; do
    impl=${run%%:*} remat=full hlo=()
    [[ $run == *:* ]] && remat=${run#*:}
    # save_attention's compiled step comes back too (gzipped HLO): on 2026-11-26 its
    # profile first showed two attention forward kernels a step where the program jax
    # lowers for CUDA has one, and it ran in full remat's time (4.45 s against 4.46,
    # pallas). The pass_trace stage named XLA's dynamic-slice-fusion-rewriter-v2, which
    # training/state.py now turns off for that policy: 3.78 s (cudnn 3.50 s).
    [[ $remat == save_attention ]] && hlo=(--hlo_out="$OUT/hlo_${seq}_${impl}_${remat}.txt.gz")
    # Command buffers off: the profile then times each kernel, not whole CUDA graphs (on,
    # three opaque buffers held 98% of a 64K step). Off for the timed steps too: compare
    # runs of one session (cudnn:full is the baseline the first session measured with
    # them on: 4.14 s a step).
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
    "$PY" -m benchmarks.train_throughput --config=gpt_64k.py --config.steps=6 --warmup=2 \
      --config.data.seq_len="$seq" --config.data.batch_size="$batch" \
      --config.optim.grad_accum=1 --config.model.attention_impl="$impl" \
      --config.model.remat="$remat" --profile_steps=1 "${hlo[@]}" \
      --result_name="train_gpt_64k_${seq}_${impl}_${remat}_gpu"
  done
}
export -f train

packages() {  # the stages' Python packages: the training stack imported, the rest found
  "$PY" - <<'PYEOF'
import importlib, importlib.util
for name in ('flax', 'optax', 'orbax.checkpoint', 'grain', 'ml_collections', 'rich',
             'tensorboardX'):
  try:
    importlib.import_module(name)
    print(f'{name}: imports')
  except Exception as e:  # pylint: disable=broad-except
    print(f'{name}: MISSING ({type(e).__name__}: {e})')
for name in ('tokenizers', 'safetensors', 'torch', 'transformers'):
  print(f'{name}: {"found" if importlib.util.find_spec(name) else "MISSING"}')
PYEOF
}
export -f packages
export PY

run_stage() {
  case $1 in
    machine) stage machine 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,\
clocks.max.sm,driver_version --format=csv; $PY -c 'import jax, jaxlib; print(\"jax\", \
jax.__version__, \"jaxlib\", jaxlib.__version__, jax.devices())'; packages" ;;
    # Eight workers (compiling is most of it), each allocating as it goes, not 75% of the
    # GPU; a test that hangs fails at 120 s instead of taking the stage's whole limit.
    # test_gpu.py (the compiled kernels against their references, 40 s on an H200) runs
    # by itself first, so its summary comes back even when test_flash_attention.py (63
    # tests compiled on the GPU, 54 s alone on an H200) runs out of time; -v names every
    # result as it lands and --durations the slowest.
    tests) stage tests "${TEST_LIMIT:-480}" env MESHLM_TEST_GPU=1 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false bash -c "a=0; $PY -m pytest -rfE -n 8 \
--timeout=120 tests/test_gpu.py || a=\$?; $PY -m pytest -v -rfE -n 8 --timeout=120 \
--durations=15 tests/test_flash_attention.py; b=\$?; exit \$((a ? a : b))" ;;
    # The paged kernel's compiled tests alone (the stacked cache, many splits).
    tests_paged) stage tests_paged "${TEST_LIMIT:-240}" env MESHLM_TEST_GPU=1 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -v -rfE -n 4 --timeout=120 \
      tests/test_gpu.py -k paged ;;
    # One device, no sharding; XLA's per-pass dumps go to a temporary directory, only the
    # JSON (the changes, the culprit) comes back. The step as training compiles it (with
    # training/state.py's PASSES_OFF: no culprit expected); PASS_TRACE_ARGS=--all_passes
    # for XLA's whole pipeline (its own file, *_all_passes_gpu.json); PASS_TRACE_REMAT another policy (none also saves the
    # kernel's output in the layer scan: the same clone is likely, not yet looked at).
    pass_trace) stage pass_trace "${PASS_TRACE_LIMIT:-180}" env \
      XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m benchmarks.hlo_pass_trace \
      --config=gpt_64k.py --remat="${PASS_TRACE_REMAT:-save_attention}" \
      ${PASS_TRACE_ARGS:-} --output=benchmarks/results/hlo_pass_trace_gpt_64k_\
"${PASS_TRACE_REMAT:-save_attention}${PASS_TRACE_ARGS:+_all_passes}"_gpu.json ;;
    attention) stage attention "${ATTENTION_LIMIT:-420}" "$PY" -m benchmarks.attention \
      ${ATTENTION_IMPLS:+--impls="$ATTENTION_IMPLS"} ;;
    tiles) stage tiles "${TILES_LIMIT:-480}" "$PY" -m benchmarks.attention --tiles ;;
    paged_decode) stage paged_decode "${PAGED_LIMIT:-150}" "$PY" -m benchmarks.paged_decode ;;
    # Splits per sequence at 1-32 sequences (the small-batch bandwidth gap), each output
    # checked against one split's.
    paged_splits) stage paged_splits "${PAGED_SPLITS_LIMIT:-240}" "$PY" -m \
      benchmarks.paged_decode --splits --iters=20 ;;
    # cuDNN, our Mosaic GPU kernels and tokamax's two (carried: gpu_wheels.sh
    # --tokamax) at 8K and 64K tokens, each checked against a float32 reference.
    tokamax) stage tokamax "${TOKAMAX_LIMIT:-300}" "$PY" -m benchmarks.attention \
      --impls=cudnn,pallas_mosaic,tokamax_mosaic,tokamax_triton --seq_lens=8192,65536 ;;
    paged_tiles) stage paged_tiles "${PAGED_LIMIT:-150}" "$PY" -m benchmarks.paged_decode \
      --tiles ;;
    # Two compiles of a 16-layer step and 17 GB of cache: more than the kernel stages.
    paged_step) stage paged_step "${PAGED_STEP_LIMIT:-300}" "$PY" -m benchmarks.paged_decode \
      --step ;;
    packed) stage packed "${PACKED_LIMIT:-240}" "$PY" -m benchmarks.attention --packed ;;
    planner) stage planner "${PLANNER_LIMIT:-300}" "$PY" -m benchmarks.planner_check \
      --configs=default.py --this-compile ;;
    planner_64k) stage planner_64k "${PLANNER_64K_LIMIT:-570}" bash -c "$PY -m \
benchmarks.planner_check --configs=gpt_64k.py --top=2 --steps=3 --batch-size=2 \
--grad-accums=1,2 && $PY \
-m benchmarks.planner_check --fit=\$(ls benchmarks/results/planner_check_gpu_*.json | \
paste -sd,)" ;;
    planner_mid) stage planner_mid "${PLANNER_LIMIT:-300}" bash -c "$PY -m \
benchmarks.planner_check --configs=default.py --top=4 --steps=10 --batch-size=512 \
--grad-accums=1,4 && $PY -m benchmarks.planner_check --fit=\$(ls \
benchmarks/results/planner_check_gpu_*.json | paste -sd,) --replan \
--fit-factors=matmul_efficiency,hbm_efficiency,launch_seconds,step_seconds" ;;
    train_64k) stage train_64k "${TRAIN_LIMIT:-570}" bash -c 'train 65536 1' ;;
    train_8k) stage train_8k "${TRAIN_LIMIT:-570}" bash -c 'train 8192 8' ;;
    # jax takes half the GPU, not its default 75%: torch runs in the same process.
    serve) stage serve "${SERVE_LIMIT:-570}" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 "$PY" -m \
      benchmarks.serve_throughput --shapes=1b --repeats="${SERVE_REPEATS:-1}" ;;
    # Three engines alive at once (their passes interleave), each with its own KV blocks:
    # jax allocates as it goes. QUANT_KV=auto,fp8,int8 adds the KV cache formats.
    quant) stage quant "${QUANT_LIMIT:-420}" env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m \
      benchmarks.quantization --shapes=1b --kv-cache-dtypes="${QUANT_KV:-auto}" --batch=64 \
      --batch-tokens=2048 --num-prompts=64 --prompt-chars=256 --max-tokens=128 --repeats=3 ;;
    *) echo "unknown stage '$1': use machine, tests, pass_trace, attention, tiles, paged_decode, \
tests_paged, paged_splits, tokamax, paged_tiles, paged_step, packed, planner, planner_64k, planner_mid, train_64k, train_8k, serve or quant"
       return 2 ;;
  esac
  # The JSON results this session wrote (at most 8 files come back from $OUT).
  find benchmarks/results -name '*.json' -newer "$START" -exec cp {} "$OUT/" \;
  return 0
}

for name in "${@:-machine tests pass_trace attention tiles paged_decode paged_tiles paged_step packed planner planner_64k planner_mid train_64k train_8k serve quant}"; do
  for one in $name; do run_stage "$one"; done
done
ls "$OUT"
