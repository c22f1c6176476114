#!/usr/bin/env bash
# llama.cpp's llama-server as a peer: built from the llama.cpp tree vendored in the
# llama-cpp-python source distribution (PyPI), CPU only, -DGGML_NATIVE=ON. Nothing is committed.
#   benchmarks/peers/llamacpp.sh build
#   benchmarks/peers/llamacpp.sh start PORT [SLOTS [llama-server flags...]]  # the GGUF as-is
#   benchmarks/peers/llamacpp.sh convert HF_DIR OUT.gguf [OUTTYPE]  # convert_hf_to_gguf.py
#                                                                    (default f16)
#   benchmarks/peers/llamacpp.sh quantize IN.gguf OUT.gguf TYPE     # llama-quantize, e.g. Q4_K_M
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
  [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] && return
  mkdir -p "$WORK" && cd "$WORK"
  if [ ! -d llama.cpp ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d sdist
    tar xzf sdist/llama_cpp_python-*.tar.gz
    mv llama_cpp_python-*/vendor/llama.cpp llama.cpp && rm -rf llama_cpp_python-*
  fi
  cmake -S llama.cpp -B "llama.cpp/$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA=OFF
  cmake --build "llama.cpp/$BUILD" --target llama-server llama-bench llama-quantize -j "$(nproc)"
}

gguf() {
  "$PY" -c "from kvserve.model_source import resolve_model; print(resolve_model('$MODEL').path)"
}

start() {
  local port="${1:-8081}" slots="${2:-32}"
  shift $(($# < 2 ? $# : 2))  # the rest: extra llama-server flags (e.g. --spec-type ngram-mod)
  build
  # On an AMX CPU (Sapphire/Emerald Rapids) this build's AMX repacked matmul dies with an
  # illegal instruction in warm-up (tile config dropped by the compiler; llama.cpp PR #26954):
  # weights are then used as the file stores them (--no-repack).
  local repack=()
  grep -q amx_tile /proc/cpuinfo && repack=(--no-repack)
  # one unified KV cache shared by all slots, BENCH_CTX tokens of context per slot
  exec "$BIN/llama-server" -m "$(gguf)" --host 127.0.0.1 --port "$port" \
    -np "$slots" -c $((slots * ${BENCH_CTX:-2048})) --kv-unified -t "$(nproc)" --alias "$MODEL" \
    "${repack[@]}" "$@"
}

convert() {  # HF_DIR OUT.gguf [OUTTYPE]: llama.cpp's converter with its own gguf-py
  [ $# -ge 2 ] || { echo "usage: $0 convert HF_DIR OUT.gguf [OUTTYPE]" >&2; exit 2; }
  [ -f "$WORK/llama.cpp/convert_hf_to_gguf.py" ] || (build)  # subshell: build cd-s
  PYTHONPATH="$WORK/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$WORK/llama.cpp/convert_hf_to_gguf.py" "$1" --outfile "$2" --outtype "${3:-f16}"
}

quantize() {  # IN.gguf OUT.gguf TYPE
  [ $# -eq 3 ] || { echo "usage: $0 quantize IN.gguf OUT.gguf TYPE" >&2; exit 2; }
  (build)  # subshell: build cd-s, relative paths stay valid
  "$BIN/llama-quantize" "$1" "$2" "$3"
}

case "${1:-}" in
  build) build ;;
  start) shift; start "$@" ;;
  convert) shift; convert "$@" ;;
  quantize) shift; quantize "$@" ;;
  *) echo "usage: $0 build | start PORT [SLOTS] | convert HF_DIR OUT.gguf [OUTTYPE]" \
          "| quantize IN OUT TYPE" >&2; exit 2 ;;
esac
