#!/usr/bin/env bash
# GPU checks in one device call: the CUDA tests, then the d12 training-step benchmark.
#   bash dev/gpu/run_all.sh [tests] [bench DESIGNS MIX TOPK ...]    (on the device machine, from the repo root)
#   MIX may be a comma list (auto,row: every MoME design once per mix); BENCH_ARGS adds flags, e.g. "--rounds 2"
export PYTHONPATH=. PYTHONUNBUFFERED=1 WANDB_MODE=disabled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
while [ $# -gt 0 ]; do
  case "$1" in
    tests) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15; shift ;;
    bench) name="${2//,/_}_${3//,/_}_$4"  # designs in the name: two bench calls with one mix write two files
           python3 bench/train_step.py --designs "$2" --mix "$3" --topk "$4" --out "$OUT/train_step_$name.json" $BENCH_ARGS \
             --profile-dir "$OUT/prof" 2>&1 | tee "$OUT/bench_$name.log" | grep -v "^ " | tail -14; shift 4 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
