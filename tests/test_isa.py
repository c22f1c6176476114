"""Instruction-set levels: KVSERVE_CPU_ISA caps the level used, never raises it, and names are
checked; the default dtype follows the level in use. No test assumes the CPU it runs on."""

import pytest
import torch

from kvserve import platform
from kvserve.kernels import get_ops, isa


def test_machine_levels_are_ordered_and_start_with_scalar():
    levels = isa.machine_levels()
    assert levels[0] == "scalar"
    assert list(levels) == sorted(levels, key=isa.LEVELS.index)


def test_tested_levels_cover_each_default_path_of_this_cpu():
    """AVX2; AVX-512 with VNNI and without bf16 (Cascade Lake's default); AVX-512 with bf16:
    each the machine can execute is tested. Plain AVX-512 only where it is the best."""
    levels, tested = isa.machine_levels(), isa.tested_levels()
    assert tested[0] == "scalar" and set(tested) <= set(levels)
    assert set(levels) - set(tested) <= {"avx512"}
    assert levels[-1] in tested


def test_cap_selects_that_level_or_the_best_below(monkeypatch):
    for cap in isa.LEVELS:
        monkeypatch.setenv(isa.ISA_ENV, cap)
        chosen = isa.selected_level()
        assert chosen in isa.machine_levels()
        assert isa.LEVELS.index(chosen) <= isa.LEVELS.index(cap)
        if cap in isa.machine_levels():
            assert chosen == cap
    monkeypatch.delenv(isa.ISA_ENV)
    assert isa.selected_level() == isa.best_level()


def test_unknown_cap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx9000")
    with pytest.raises(isa.UnknownIsaError, match="KVSERVE_CPU_ISA"):
        isa.selected_level()


def test_default_dtype_is_float32_below_native_bf16(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert platform.default_dtype("cpu") == torch.float32
    monkeypatch.setattr(isa, "has_native_bf16", lambda: False)
    monkeypatch.delenv(isa.ISA_ENV)
    assert platform.default_dtype("cpu") == torch.float32


def test_each_level_builds_its_own_module(kernels):
    assert kernels.compiled and kernels.isa in isa.machine_levels()
    assert get_ops(True, kernels.isa).isa == kernels.isa
    assert get_ops(False).isa == "torch"
