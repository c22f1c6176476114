"""A kernel build that fails, fails loudly: `python -m kvserve.kernels` (run by `make install`)
exits non-zero naming the level and the compiler's error, and the engine raises a
KernelBuildError instead of running the torch reference ops unasked; KVSERVE_KERNELS=reference
and --no-cpu-kernels are the explicit ways to those ops. The broken compiler is `CXX=false`
(torch's cpp_extension reads CXX), building into a temporary cache directory so the real builds
are not touched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import KernelBuildError
from kvserve.kernels import KERNELS_ENV, cpu_ext, get_ops, isa, kernels_choice, reference
from kvserve.kernels.__main__ import main as build_main
from kvserve.kernels.cpu_ext import error_gist


@pytest.fixture
def broken_compiler(tmp_path, monkeypatch):
    """CXX=false, a fresh cache directory, and no level built yet in this process."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setattr(cpu_ext, "_failures", {})
    return tmp_path / "cache"


def _assert_clear(message: str, level: str) -> None:
    assert f"the C++ CPU kernels ({level}) are unavailable" in message
    assert "compiler 'false'" in message and "`false --version` exited" in message
    assert "KVSERVE_KERNELS=reference" in message


def test_a_broken_compiler_fails_the_build_step(broken_compiler):
    """What `make install` runs, as it runs it."""
    result = subprocess.run([sys.executable, "-m", "kvserve.kernels"], env=dict(os.environ),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode != 0, result.stdout
    _assert_clear(result.stderr, isa.selected_level())
    assert (broken_compiler / "kernels").is_dir()  # it built there, not in the real cache


def test_every_level_that_fails_is_named(broken_compiler, capsys):
    assert build_main(["all"]) == 1
    errors = capsys.readouterr().err
    for level in isa.tested_levels():
        _assert_clear(errors, level)


def test_nothing_to_build_when_reference_ops_are_asked_for(broken_compiler, monkeypatch,
                                                           capsys):
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert build_main([]) == 0
    assert "reference" in capsys.readouterr().out


def test_the_engine_raises_instead_of_falling_back(broken_compiler, tiny_model_dir):
    with pytest.raises(KernelBuildError) as error:
        LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, engine_core="thread")
    _assert_clear(str(error.value), isa.selected_level())


@pytest.mark.parametrize("how", ["--no-cpu-kernels", "KVSERVE_KERNELS=reference"])
def test_the_reference_ops_when_asked_for(broken_compiler, tiny_model_dir, monkeypatch, how):
    options = {}
    if how == "--no-cpu-kernels":
        options["cpu_kernels"] = False
    else:
        monkeypatch.setenv(KERNELS_ENV, "reference")
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
              engine_core="thread", **options)
    output = llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 3
    assert not llm.llm_engine.engine_core.runner.model.kernel_ops.compiled
    llm.shutdown()


def test_the_server_cli_says_why_across_the_core_process(broken_compiler, tiny_model_dir):
    """The error crosses from the engine core's process with its type and message."""
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "Hello", "--model",
         str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "3", "--num-kv-blocks",
         "64", "--engine-core", "process"],
        env=dict(os.environ), capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: the C++ CPU kernels" in result.stderr
    _assert_clear(result.stderr, isa.selected_level())


def test_kernels_choice(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "reference")
    ops = get_ops(True)
    assert not ops.compiled and ops.isa == "torch" and ops.rms_norm is reference.rms_norm
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="KVSERVE_KERNELS"):
        kernels_choice()
    monkeypatch.delenv(KERNELS_ENV)
    assert kernels_choice() == "compiled"


def test_the_gist_is_the_compiler_error_line():
    ninja_output = RuntimeError(
        "Error building extension 'k': [1/2] c++ -O3 -c a.cpp -o a.o\n"
        "FAILED: [code=1] a.o\nc++ -O3 -c a.cpp -o a.o\n"
        "a.cpp:12:3: error: 'foo' was not declared in this scope\n"
        "ninja: build stopped: subcommand failed.\n")
    assert error_gist(ninja_output) == "a.cpp:12:3: error: 'foo' was not declared in this scope"
    no_diagnostic = RuntimeError("Error building extension 'k': [1/2] c++ -c a.cpp\n"
                                 "FAILED: a.o\nninja: build stopped: subcommand failed.\n")
    assert error_gist(no_diagnostic) == "FAILED: a.o"
    missing = subprocess.CalledProcessError(1, ["g++-99", "--version"])
    assert error_gist(missing) == "`g++-99 --version` exited with status 1"
