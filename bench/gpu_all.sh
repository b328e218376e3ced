#!/usr/bin/env bash
# Every GPU check of the trainer in one go, each time-limited, within BUDGET_S seconds (default 560, so that it fits
# one 10-minute device call with the install), about 7-9 minutes on an H100/H200:
#   bash bench/gpu_all.sh [OUT_DIR]
# 1. the CUDA tests (no host-device sync between log/eval steps under set_sync_debug_mode("error"), compile, CUDA
#    graphs, the multi-tensor Lion, TF32, device metrics); 1b. bench/batched.py on the GPU (batched training, issue 16:
#    trials/hour of K configs as one stacked model vs one after another, digits and a small charlm at K up to 256,
#    and the stacked 10.8M-parameter charlm's MFU); 1c. bench/cohorts.py on charlm-sized trials (issue 17: trials per
#    GPU-hour of a study run in cohorts of 8 vs one trial at a time); 2. bench/gpu.py (tokens/s and MFU eager and compiled, trials
#    per GPU-hour, GPU busy during a short two-worker charlm study of 500-step trials); 3. bench/overhead.py's CUDA case
#    (the trainer vs a hand-written loop); 4. bench/distributed.py on 2 GPUs (NCCL: DDP, the verdict broadcast's cost
#    per evaluation, 1- vs 2-rank deviation; skipped with one GPU); 5. with the time left, bench/gpu.py's `graphs`
#    part (CUDA graphs).
# Logs and gpu.json (rewritten after each part) go to OUT_DIR (default results/), the graphs part's to OUT_DIR/graphs/. The study part needs
# optuna and SQLAlchemy importable; the rest needs torch only.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
deadline=$((SECONDS + ${BUDGET_S:-560}))

# run LIMIT_S LOG COMMAND...: at most LIMIT_S seconds, and never past the deadline; the output is also in OUT/LOG.
run() {
    local limit=$1 log=$2 left=$((deadline - SECONDS))
    shift 2
    if ((left < 20)); then
        echo "skipped, too little time left: $*" | tee "$out/$log"
        return
    fi
    timeout $((left < limit ? left : limit)) "$@" 2>&1 | tee "$out/$log"
}

(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$python" -c "import torch; print('torch', torch.__version__)") 2>&1 | tee "$out/env.log"
run 200 cuda_tests.log "$python" -m pytest tests/trainer/test_cuda.py -q -p no:cacheprovider
# Batched training: the sequential side is timed on the first --solo-max configs only (its time grows linearly).
run 80 batched.log "$python" bench/batched.py --device cuda --tasks digits charlm --ks 1 16 64 256 --steps 300 \
    --solo-max 8
run 90 batched_charlm.log "$python" bench/batched.py --device cuda --tasks charlm-10m --ks 8 32 --steps 60 \
    --solo-max 2
# Cohorts under a real study (issue 17): 16 charlm.yaml-sized trials one at a time vs in cohorts of 8, trials/GPU-hour.
run 180 cohorts.log "$python" bench/cohorts.py --task charlm --trials 16 --steps 100 --cohorts 1 8 --seeds 0
# The study: charlm.yaml's trials cut to 500 steps (its pruner's warm-up), so that 4 trials on 2 workers end well
# inside the part's 75 s.
run 370 gpu.log "$python" bench/gpu.py --out "$out" --study studies/charlm.yaml --study-workers 2 --study-trials 4 \
    --study-timeout 30 --study-steps 500
run 115 overhead.log "$python" bench/overhead.py --only cuda
# Data-parallel trials on 2 GPUs (NCCL): never run before this script; it needs 2 visible GPUs.
if (( $("$python" -c "import torch; print(torch.cuda.device_count())") >= 2 )); then
    run 90 distributed.log "$python" bench/distributed.py --device cuda --quick
else
    echo "skipped: bench/distributed.py --device cuda needs 2 GPUs" | tee "$out/distributed.log"
fi
# The graphs part's own limit (150 s at --time-scale 1) is shrunk to the time left, so that its table still prints.
scale=$(awk -v left=$((deadline - SECONDS - 10)) 'BEGIN { s = left / 150; print (s > 1 ? 1 : s) }')
run 160 graphs.log "$python" bench/gpu.py --parts graphs --time-scale "$scale" --out "$out/graphs"
