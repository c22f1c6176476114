#!/usr/bin/env bash
# llama.cpp's llama-server as a peer: built from the llama.cpp tree vendored in the
# llama-cpp-python source distribution (PyPI), CPU only, -DGGML_NATIVE=ON. Nothing is committed.
#   benchmarks/peers/llamacpp.sh build
#   benchmarks/peers/llamacpp.sh start PORT [SLOTS [llama-server flags...]]  # the GGUF as-is
# BENCH_MODEL (a kvserve short name, default smollm2-135m-instruct) picks the GGUF, BENCH_CTX the
# context per slot (default 2048).
# With KVSERVE_CPU_ISA=avx2 (an AVX-512 machine standing in for an AVX2-only one) it builds and
# runs a separate AVX2 + FMA + F16C build, as llama.cpp would be on such a CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${PEERS_DIR:-$ROOT/benchmarks/peers/work}"
PY="$ROOT/.venv/bin/python"
if [ "${KVSERVE_CPU_ISA:-}" = "avx2" ]; then
  BUILD="build-avx2"
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
else
  BUILD="build"
  ISA_FLAGS=(-DGGML_NATIVE=ON)
fi
BIN="$WORK/llama.cpp/$BUILD/bin"
MODEL="${BENCH_MODEL:-smollm2-135m-instruct}"

build() {
  [ -x "$BIN/llama-server" ] && return
  mkdir -p "$WORK" && cd "$WORK"
  if [ ! -d llama.cpp ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d sdist
    tar xzf sdist/llama_cpp_python-*.tar.gz
    mv llama_cpp_python-*/vendor/llama.cpp llama.cpp && rm -rf llama_cpp_python-*
  fi
  cmake -S llama.cpp -B "llama.cpp/$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA=OFF
  cmake --build "llama.cpp/$BUILD" --target llama-server llama-bench -j "$(nproc)"
}

gguf() {
  "$PY" -c "from kvserve.model_source import resolve_model; print(resolve_model('$MODEL').path)"
}

start() {
  local port="${1:-8081}" slots="${2:-32}"
  shift $(($# < 2 ? $# : 2))  # the rest: extra llama-server flags (e.g. --spec-type ngram-mod)
  build
  # one unified KV cache shared by all slots, BENCH_CTX tokens of context per slot
  exec "$BIN/llama-server" -m "$(gguf)" --host 127.0.0.1 --port "$port" \
    -np "$slots" -c $((slots * ${BENCH_CTX:-2048})) --kv-unified -t "$(nproc)" --alias "$MODEL" "$@"
}

case "${1:-}" in
  build) build ;;
  start) shift; start "$@" ;;
  *) echo "usage: $0 build | start PORT [SLOTS]" >&2; exit 2 ;;
esac
