"""Which machine and kernel instruction-set level a benchmark ran with: the header every report
carries, and the CPU slug results are filed under. CPUs differ between our machines (Zen 5, Zen 4,
AVX2-only Zen 3), so a number means nothing without the CPU and ISA level beside it.
"""

from __future__ import annotations

import os
import platform
import re

from kvserve.kernels import isa


def machine_header() -> dict:
    """CPU model name, family, model number and the kernel ISA level in use (from this process's
    environment: pass the server the same KVSERVE_CPU_ISA and it runs the same level)."""
    cpu = isa.cpu_description()
    return {
        "cpu_model_name": cpu["model_name"] or platform.processor() or "unknown CPU",
        "cpu_family": cpu["family"],
        "cpu_model": cpu["model"],
        "isa_level": isa.selected_level(),
        "kvserve_cpu_isa": os.environ.get(isa.ISA_ENV) or None,
        "machine_isa_levels": list(isa.machine_levels()),
        "native_bf16": isa.has_native_bf16(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
    }


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_slug(header: dict) -> str:
    """"amd-epyc-f25-m17", plus "-isa-avx2" when the level is capped below the machine's best,
    so runs on the same CPU at different levels never mix."""
    slug = _slugify(header["cpu_model_name"]) or "unknown-cpu"
    if header.get("cpu_family"):
        slug += f"-f{_slugify(str(header['cpu_family']))}"
    if header.get("cpu_model"):
        slug += f"-m{_slugify(str(header['cpu_model']))}"
    levels = header.get("machine_isa_levels") or []
    if levels and header["isa_level"] != levels[-1]:
        slug += f"-isa-{_slugify(header['isa_level'])}"
    return slug


def cpu_label(header: dict) -> str:
    """One line for a report, e.g. "AMD EPYC (family 25, model 17), kernels avx2 of avx512_bf16
    (KVSERVE_CPU_ISA=avx2)"."""
    label = header["cpu_model_name"]
    if header.get("cpu_family") or header.get("cpu_model"):
        label += f" (family {header.get('cpu_family', '?')}, model {header.get('cpu_model', '?')})"
    label += f", kernels {header['isa_level']}"
    levels = header.get("machine_isa_levels") or []
    if levels and header["isa_level"] != levels[-1]:
        label += f" of {levels[-1]}"
    if header.get("kvserve_cpu_isa"):
        label += f" ({isa.ISA_ENV}={header['kvserve_cpu_isa']})"
    return label
