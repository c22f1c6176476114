"""The layering holds at run time too: the router and the bench client start without torch or
the engine, nothing in the package reaches for its test support, and test files share helpers
only through tests/helpers.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"
TESTS = Path(__file__).resolve().parent
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


def test_test_files_share_helpers_only_through_tests_helpers():
    """No test file imports another test file or conftest (fixtures reach tests by name)."""
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}: {name}" for name in names
                          if name.startswith("tests") and name != "tests.helpers"]
            offenders += [f"{path.name}: {name}" for name in names
                          if name.split(".")[0] in ("conftest", "helpers")
                          or name.startswith("test_")]
    assert offenders == []
