"""`python -m kvserve.kernels [LEVEL ...]`: build the C++ CPU kernels ahead of time (make install
does, for the level the engine will use; `all` builds every level this CPU can execute)."""

import logging
import sys

from kvserve.kernels import isa
from kvserve.kernels.cpu_ext import build_failure, load_cpu_kernels

logging.basicConfig(level=logging.INFO)
requested = sys.argv[1:] or [isa.selected_level()]
levels = list(isa.machine_levels()) if requested == ["all"] else requested
for level in levels:
    ready = load_cpu_kernels(level) is not None
    print(f"CPU kernels ({level}):", "ready" if ready else f"unavailable ({build_failure(level)})")
