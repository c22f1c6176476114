"""The layering holds at run time too: the router and the bench client start without torch or
the engine, and nothing in the package reaches for its test support."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"
HEAVY = ("torch", "kvserve.engine", "kvserve.core", "kvserve.executor", "kvserve.worker",
         "kvserve.models")


@pytest.mark.parametrize("module", ["kvserve", "kvserve.router", "kvserve.router.app",
                                    "kvserve.bench.client", "kvserve.protocol.engine_core"])
def test_light_modules_load_neither_torch_nor_the_engine(module):
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "", f"importing {module} loaded {loaded}"


def test_the_package_never_imports_its_test_support():
    offenders = [str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                 if "testing" not in path.relative_to(PACKAGE).parts[:1]
                 and "kvserve.testing" in path.read_text()]
    assert offenders == []


def test_the_import_contracts_hold():
    """import-linter's layer, forbidden and acyclic contracts (pyproject.toml)."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stdout[-3000:]
