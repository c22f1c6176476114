"""`python -m kvserve.kernels`: build the C++ CPU kernels ahead of time (make install does)."""

import logging

from kvserve.kernels.cpu_ext import build_failure, load_cpu_kernels

logging.basicConfig(level=logging.INFO)
print("CPU kernels:", "ready" if load_cpu_kernels() else f"unavailable ({build_failure()})")
