#!/usr/bin/env bash
# Every GPU check of the trainer in one go, each time-limited, about 7 minutes on an H100/H200:
#   bash bench/gpu_all.sh [OUT_DIR]
# 1. the CUDA tests (no host-device sync between log/eval steps under set_sync_debug_mode("error"), compile, TF32,
#    device metrics); 2. bench/gpu.py (tokens/s and MFU eager and compiled, trials per GPU-hour, GPU busy during a
#    short two-worker charlm study); 3. bench/overhead.py's CUDA case (the trainer vs a hand-written loop).
# Logs and gpu.json go to OUT_DIR (default results/). The study part needs optuna and SQLAlchemy importable; the rest
# needs torch only.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$python" -c "import torch; print('torch', torch.__version__)") 2>&1 | tee "$out/env.log"
timeout 130 "$python" -m pytest tests/trainer/test_cuda.py -q -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.log"
timeout 330 "$python" bench/gpu.py --out "$out" --study studies/charlm.yaml --study-workers 2 --study-trials 4 \
    --study-timeout 25 2>&1 | tee "$out/gpu.log"
timeout 115 "$python" bench/overhead.py --only cuda 2>&1 | tee "$out/overhead.log"
