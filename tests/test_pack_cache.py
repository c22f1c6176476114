"""The packed-panel cache of a GGUF (quant/pack_cache.py): a second load maps the panels the
first one packed (their memory is the cache file's), with the same logits to the bit; a
truncated cache, or one whose panels differ from a fresh pack, is never served."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.quant import pack_cache
from kvserve.quant.pack_cache import PackCache
from tests.helpers import write_q4_k_m

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """A tiny Q4_K_M-typed Llama, cached despite its size, its packed panels in a directory of
    their own (the autotuner's cache stays the machine's: no re-measuring)."""
    monkeypatch.setattr(pack_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(pack_cache, "artifact_path",
                        lambda path, suffix: tmp_path / "cache" / f"{path.stem}.{suffix}")
    return write_q4_k_m(tmp_path / "tiny-q4_k_m.gguf", tied=False)


def _load(path):
    model, _ = load_model(resolve_model(path), "float32", attention_backend="paged",
                          quantization="gguf")
    logits = PagedLoop(model, 1, 64).step([PROMPT[:12]], [12], [0], all_logits=True)[0]
    for thread in threading.enumerate():  # the first load's copy, written in the background
        if thread.name == "kvserve-pack-cache":
            thread.join()
    return model, logits


def _panels(model) -> list[torch.Tensor]:
    return [segment.panels for module in model.modules() if type(module).__name__ ==
            "StoredLinear" for segment in module.segments]


def _mapped_path(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's memory (None: anonymous memory, the heap)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_a_second_load_maps_what_the_first_packed(model_file):
    first, logits = _load(model_file)
    cache = PackCache(model_file)
    assert cache.mapped is not None
    assert all(_mapped_path(panels) is None for panels in _panels(first))  # packed in memory
    second, again = _load(model_file)
    assert torch.equal(logits, again)
    panels = _panels(second)
    assert len(cache.entries) == len(panels) > 0
    assert {_mapped_path(p) for p in panels} == {str(cache.data_path)}
    for ours, theirs in zip(panels, _panels(first)):
        assert torch.equal(ours, theirs)


def test_a_truncated_cache_is_packed_afresh_and_written_again(model_file, caplog):
    _, logits = _load(model_file)
    data = PackCache(model_file).data_path
    size = data.stat().st_size
    with open(data, "r+b") as out:
        out.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="kvserve.quant.pack_cache"):
        model, again = _load(model_file)
    assert "ignoring the packed-weights cache" in caplog.text
    assert torch.equal(logits, again)
    assert all(_mapped_path(p) is None for p in _panels(model))
    assert data.stat().st_size == size  # rewritten whole


def test_panels_that_differ_from_a_fresh_pack_are_not_served(model_file, caplog):
    """A cache whose bytes are not what this build packs (another layout, a corrupt page):
    each run is checked on its first panel before it is served."""
    _, logits = _load(model_file)
    cache = PackCache(model_file)
    key, (offset, _) = next(iter(cache.entries.items()))
    with open(cache.data_path, "r+b") as out:
        out.seek(offset + 5)
        byte = out.read(1)[0]
        out.seek(offset + 5)
        out.write(bytes([byte ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="kvserve.quant.pack_cache"):
        model, again = _load(model_file)
    assert f"fresh pack of {key}" in caplog.text
    assert torch.equal(logits, again)
    assert sum(_mapped_path(p) is None for p in _panels(model)) == 1


def test_a_write_abandoned_by_a_killed_process_is_removed(model_file):
    cache = PackCache(model_file)
    cache.data_path.parent.mkdir(parents=True)
    abandoned = cache.data_path.with_name(cache.data_path.name + ".partial-999999999")
    abandoned.write_bytes(b"half a copy")
    _load(model_file)
    assert not abandoned.exists() and PackCache(model_file).mapped is not None


def test_the_switch_turns_it_off(model_file, monkeypatch):
    monkeypatch.setenv("KVSERVE_PACK_CACHE", "0")
    _load(model_file)
    cache = PackCache(model_file)
    assert cache.mapped is None and not cache.data_path.exists()


def test_weights_beyond_the_memory_available_are_served_from_the_cache_files_map(
        model_file, monkeypatch, caplog):
    """Less memory available than the weights need (`KVSERVE_AVAILABLE_MEMORY_BYTES`, as a
    cgroup's limit would say): the load neither fails nor holds the panels in its memory; each
    run goes to the cache file as it is packed and is served from the file's map (pages the
    kernel may drop and read again), with the logits of a load in memory to the bit; the file
    is then a complete cache a later load maps. Too little memory for the KV cache reserve
    itself is still a typed error naming it."""
    from kvserve.errors import InsufficientMemoryError

    _, expected = _load(model_file)
    PackCache(model_file).data_path.unlink()  # the next load packs again, beyond memory
    PackCache(model_file).index_path.unlink()
    monkeypatch.setenv("KVSERVE_AVAILABLE_MEMORY_BYTES", str(64 << 10))
    with caplog.at_level(logging.WARNING, logger="kvserve.models.loader"):
        model, logits = _load(model_file)
    assert "served from a map of the packed-panel cache" in caplog.text
    assert "slower" in caplog.text
    assert torch.equal(logits, expected)
    cache = PackCache(model_file)
    panels = _panels(model)
    assert cache.mapped is not None and len(cache.entries) == len(panels) > 0
    assert {_mapped_path(p) for p in panels} == {str(cache.data_path)}
    assert not list(cache.data_path.parent.glob("*.partial-*"))
    monkeypatch.delenv("KVSERVE_AVAILABLE_MEMORY_BYTES")
    again, logits = _load(model_file)
    assert torch.equal(logits, expected) and cache.data_path.exists()
    monkeypatch.setenv("KVSERVE_AVAILABLE_MEMORY_BYTES", str(64 << 10))
    with pytest.raises(InsufficientMemoryError, match="KV cache"):
        load_model(resolve_model(model_file), "float32", attention_backend="paged",
                   quantization="gguf", reserve_bytes=1 << 20)


def test_weights_beyond_memory_with_a_full_disk_fail_typed_and_leave_nothing(
        model_file, monkeypatch):
    """The weights fit neither in memory nor on the cache's disk (a write fails, ENOSPC): a
    typed error naming the file, and no partial copy left behind."""
    import errno

    from kvserve.errors import InsufficientMemoryError

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pack_cache.os, "fdatasync", full)
    monkeypatch.setenv("KVSERVE_AVAILABLE_MEMORY_BYTES", str(64 << 10))
    with pytest.raises(InsufficientMemoryError, match="No space left on device"):
        _load(model_file)
    cache = PackCache(model_file)
    assert not cache.data_path.exists()
    assert not list(cache.data_path.parent.glob("*.partial-*"))
