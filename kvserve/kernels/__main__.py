"""`python -m kvserve.kernels [LEVEL ...]`: build the C++ CPU kernels ahead of time (make install
does, for the level the engine will use; `all` builds every level the tests run,
`isa.tested_levels()`). Exits 1, naming the level and the compiler's error, when a level does
not build, so `make install` fails instead of leaving an engine that cannot start; with
KVSERVE_KERNELS=reference there is nothing to build."""

from __future__ import annotations

import logging
import sys

from kvserve.kernels import KERNELS_ENV, KernelBuildError, compiled_ops, isa, kernels_choice


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO)
    if kernels_choice() == "reference":
        print(f"{KERNELS_ENV}=reference: the engine runs the torch reference ops; not building "
              "the C++ CPU kernels")
        return 0
    requested = argv or [isa.selected_level()]
    levels = list(isa.tested_levels()) if requested == ["all"] else requested
    failed = []
    for level in levels:
        try:
            compiled_ops(level)
        except (KernelBuildError, isa.UnknownIsaError) as error:
            print(f"error: {error}", file=sys.stderr)
            failed.append(level)
        else:
            print(f"CPU kernels ({level}): ready")
    if failed:
        print(f"error: the C++ CPU kernels did not build for {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
