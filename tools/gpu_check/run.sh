#!/usr/bin/env bash
# On the GPU machine, from the repo root (after prepare.sh here): install the carried wheels,
# run every check, log to $OUT/gpu_check.log. Exit status 1 when a check FAILs.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .devcheck/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KVSERVE_CACHE_DIR=/tmp/kvserve-cache HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 420 python3 tools/gpu_check/gpu_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
