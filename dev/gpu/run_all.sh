#!/usr/bin/env bash
# GPU checks in one device call: the CUDA tests, MoME's ops alone, the d12 training-step benchmark.
#   bash dev/gpu/run_all.sh [tests] [ops] [bench DESIGNS MIX TOPK ...] [diff A B] (on the device machine, from the repo root)
#   ops: bench/mome_ops.py (MoME's ops alone, variants checked then timed; OPS_ARGS adds flags, e.g. "--ops rowmix")
#   MIX may be a comma list (auto,row: every MoME design once per mix); BENCH_ARGS adds flags, e.g. "--rounds 2"
#   or "--profile-dir $OUT/prof" (per design <design>_<mix>_<topk>[_stk]: a top-40 op table, .txt, and every kernel,
#   .json; _stk with --shared-table-kernel on); BENCH_TAG=x adds _x to its file names. The tests need pytest-xdist and pytest-timeout
#   (the device image has both).
#   diff A.json B.json: bench/profile_diff.py's comparison of two --profile-dir kernel files (DIFF_TOP rows, 40).
#   TESTS_FILES / TESTS_K narrow the tests (default: every gpu test of tests/), e.g. TESTS_FILES="tests/test_gpu.py
#   tests/test_base_eval.py" TESTS_K="mome_kernels or fused_and_torch_kernels". Wheels in .whl/ (bash dev/gpu/fetch_wheels.sh here, then `carry: [".whl"]`) are installed first:
#   rustbpe, which the image lacks and base_eval's CUDA test needs for its tiny tokenizer.
#   TESTS_LIMIT / OPS_LIMIT / BENCH_LIMIT: seconds each step may run (default 240 / 285 / 330), so that one call ends
#   inside the device tool's 10-minute limit; both benches write their JSON as they go, so a stopped one keeps rows.
# Budget (H100, 2026-11-26): the 54 CUDA tests took 96 s with 4 workers; a bench process ~80 s on a fresh machine
# (40-44 s compiling), ~27 s once the inductor cache below holds its graphs (a warm machine keeps runs/ between calls).
# On an H200 (2026-11-26) graphs new to the cache took 50-62 s of warm-up: give each such bench process ~100 s.
export PYTHONPATH=. PYTHONUNBUFFERED=1 WANDB_MODE=disabled OMP_NUM_THREADS=4
export TORCHINDUCTOR_CACHE_DIR="$PWD/runs/inductor"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" runs
if compgen -G ".whl/*.whl" > /dev/null; then  # said either way: a silent failure read as a test's own error
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .whl/*.whl; then
    export PYTHONPATH=".:/tmp/site"; echo "wheels: $(ls .whl | tr '\n' ' ')"
  else
    echo "wheels: install FAILED (.whl: $(ls .whl | tr '\n' ' ' | sed 's/ $//')): the tests that import them fail"
  fi
fi
python3 -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
while [ $# -gt 0 ]; do
  case "$1" in
    tests) timeout "${TESTS_LIMIT:-240}" python3 -m pytest -q -m gpu ${TESTS_FILES:-tests/} ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider -n 4 --timeout 150 -rfEs \
             > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
           grep -E "passed|failed|FAILED|ERROR|SKIPPED|Timeout" "$OUT/gpu_tests.log" | tail -30; shift ;;
    ops) timeout "${OPS_LIMIT:-285}" python3 bench/mome_ops.py --out "$OUT/mome_ops.json" $OPS_ARGS > "$OUT/mome_ops.log" 2>&1
         echo "ops rc=$?"; tail -30 "$OUT/mome_ops.log"; shift ;;
    bench) name="${2//,/_}_${3//,/_}_$4${BENCH_TAG:+_$BENCH_TAG}"  # BENCH_TAG tells apart two calls of one name
           timeout "${BENCH_LIMIT:-330}" python3 bench/train_step.py --designs "$2" --mix "$3" --topk "$4" \
             --out "$OUT/train_step_$name.json" $BENCH_ARGS > "$OUT/bench_$name.log" 2>&1; echo "bench rc=$?"
           grep -v "^ " "$OUT/bench_$name.log" | tail -14; shift 4 ;;
    diff) python3 bench/profile_diff.py "$2" "$3" --top "${DIFF_TOP:-40}"; echo "diff rc=$?"; shift 3 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
