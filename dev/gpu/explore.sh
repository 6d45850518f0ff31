#!/usr/bin/env bash
# First look at the current code on a GPU: tiny CUDA train + resume, then d12 throughput per design (compiled).
# Run on the device machine from the repo root: bash dev/gpu/explore.sh  (writes under $OUT)
export PYTHONPATH=. PYTHONUNBUFFERED=1 WANDB_MODE=disabled
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch;print('torch',torch.__version__,torch.version.cuda)"
T="python3 -m scripts.base_train --synthetic-data --eval-tokens 4096 --no-final-core --no-final-train-bpb"
echo "== tiny CUDA train, save every 2, then resume from step 2"
$T --depth 2 --max-seq-len 128 --device-batch-size 4 --total-batch-size 512 --num-iterations 4 --save-every 2 \
   --keep-last 0 --memory mome --run-dir /tmp/r_tiny --overwrite --log-every 2 > $OUT/tiny.log 2>&1; echo "rc=$?"; tail -3 $OUT/tiny.log
$T --depth 2 --max-seq-len 128 --device-batch-size 4 --total-batch-size 512 --num-iterations 4 --save-every 2 \
   --keep-last 0 --memory mome --run-dir /tmp/r_tiny --resume 2 --log-every 2 > $OUT/tiny_resume.log 2>&1; echo "resume rc=$?"; tail -5 $OUT/tiny_resume.log
echo "== d12 throughput, compile, 1 GPU, 32x2048 per step, 12 steps"
for d in "base" "ve" "bigram" "mome" "mome --mome-index bigram --mome-bigram-factor 6"; do
  name=$(echo $d | tr ' ' '_' | tr -d '-')
  $T --depth 12 --max-seq-len 2048 --device-batch-size 32 --total-batch-size 65536 --num-iterations 12 \
     --compile --memory $d --run-dir /tmp/r_$name --overwrite --eval-tokens 65536 > $OUT/d12_$name.log 2>&1
  echo "$d rc=$?"; grep -E "^step 0001[0-2]" $OUT/d12_$name.log | tail -2; grep -iE "error|Traceback" $OUT/d12_$name.log | head -3
  python3 -c "
import torch,json
r=[json.loads(l) for l in open('/tmp/r_$name/metrics.jsonl') if '\"train\"' in l]
dts=sorted(x['dt'] for x in r[4:]); print('$name median dt %.4f s tok/s %.0f'%(dts[len(dts)//2], 65536/dts[len(dts)//2]))" 2>&1 | tail -1
done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
