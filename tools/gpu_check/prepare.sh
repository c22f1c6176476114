#!/usr/bin/env bash
# Build what tools/gpu_check/run.sh needs on a GPU machine that has torch but no network:
# the tiny models and the wheels of the packages its image lacks, all under .devcheck/
# (git-ignored; pass it as the device call's `carry`). Run from the repo root, once.
set -euo pipefail
grep -qx '/.devcheck/' .git/info/exclude 2>/dev/null || echo '/.devcheck/' >> .git/info/exclude
.venv/bin/python tools/gpu_check/make_tiny.py
mkdir -p .devcheck/whl
for package in msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0; do
  .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .devcheck/whl "$package"
done
