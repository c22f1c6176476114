"""The KV cache's transparent huge pages (kvserve/huge_pages.py): asked for before the zeros
touch the pages, taken where the kernel's THP setting allows it, and off with the switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.attention.kv_tensors import attention_page_layout
from kvserve.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGES_ENV, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _mappings_under(tensor: torch.Tensor) -> list[dict[str, str]]:
    """/proc/self/smaps' entries (field -> value) of the mappings overlapping the tensor's
    storage: the advice splits the allocation's mapping at the 2 MB boundaries."""
    begin = tensor.untyped_storage().data_ptr()
    end = begin + tensor.untyped_storage().nbytes()
    mappings, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(part, 16) for part in head.split("-"))
            current = {"span": head} if low < end and begin < high else None
            if current is not None:
                mappings.append(current)
        elif current is not None and ":" in line:
            field, value = line.split(":", 1)
            current[field] = value.strip()
    return mappings


def _huge_bytes_under(tensor: torch.Tensor) -> int:
    return sum(int(m["AnonHugePages"].split()[0]) * 1024 for m in _mappings_under(tensor))


def _advised_bytes_under(tensor: torch.Tensor) -> int:
    """Bytes of the mappings carrying MADV_HUGEPAGE (VmFlags `hg`)."""
    total = 0
    for mapping in _mappings_under(tensor):
        if "hg" in mapping.get("VmFlags", "").split():
            low, high = (int(part, 16) for part in mapping["span"].split("-"))
            total += high - low
    return total


def _thp_fallbacks() -> int:
    """The kernel's count of faults that wanted a huge page and got 4 KB ones (no free 2 MB
    page: memory fragmented by whatever ran before)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def _allocate_kv(blocks: int = 2048) -> torch.Tensor:
    # 2 planes x 2048 blocks x 16 slots x 8 heads x 64 bf16 = 64 MiB: above glibc's largest
    # mmap threshold (32 MiB), so fresh pages whatever earlier tests freed (reused heap pages
    # already touched keep their size, and a heap range advised earlier keeps its advice)
    return attention_page_layout(8, 64, torch.bfloat16).allocate(blocks, 16)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off (or unknown) on this kernel")
def test_kv_cache_lands_on_huge_pages_and_is_zero():
    fallbacks = _thp_fallbacks()
    cache = _allocate_kv()
    assert not cache.any()
    # the advice covers all but the unaligned ends; the kernel then gives huge pages, or
    # counts a fallback where fragmented memory had no free 2 MB page (seen late in the full
    # suite): the page size is the kernel's to give, the asking is ours to test
    assert _advised_bytes_under(cache) >= cache.untyped_storage().nbytes() - HUGE_PAGE_BYTES
    assert _huge_bytes_under(cache) >= HUGE_PAGE_BYTES or _thp_fallbacks() > fallbacks


@pytest.mark.skipif(_thp_mode() != "madvise",
                    reason="only under THP `madvise` does the advice decide the page size")
def test_switch_off_keeps_4k_pages(monkeypatch):
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    cache = _allocate_kv()
    assert not cache.any()
    assert _advised_bytes_under(cache) == 0
    assert _huge_bytes_under(cache) == 0


def test_advice_is_refused_without_a_whole_huge_page(monkeypatch):
    # below a huge page or with the switch off the buffer is plain torch.zeros, which may sit in
    # heap memory that another library (torch's allocator, oneDNN) advised earlier in the same
    # process: smaps cannot tell whose advice it carries, so the test watches our own calls
    advised = []
    monkeypatch.setattr("kvserve.huge_pages._advise", lambda *span: advised.append(span))
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    small = zeros_on_huge_pages((1000,), torch.uint8)
    assert not small.any() and advised == []
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    switched_off = zeros_on_huge_pages((8 << 20,), torch.uint8)
    assert not switched_off.any() and advised == []
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    switched_on = zeros_on_huge_pages((8 << 20,), torch.uint8)
    assert not switched_on.any() and len(advised) == 1
