"""Read checkpoint tensors from safetensors files one at a time, whole or as lazy slices.

safetensors' lazy slices read only the requested bytes of a memory-mapped file, so a
tensor-parallel rank that takes its slice of each tensor (the model's layers apply their own
shard rules) never reads the other ranks' weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from kvserve.errors import CorruptModelFileError


def iter_safetensors(files: Iterable[Path], lazy: bool = False) -> Iterator[tuple[str, object]]:
    """(name, tensor) for every tensor of the files, in file order; `lazy`: safetensors' slice
    objects instead (index them to read: `slice[a:b]`, `slice[:]`)."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)
        except (OSError, ValueError, SafetensorError) as exc:
            raise CorruptModelFileError(f"Cannot read {file}: {exc}") from exc
