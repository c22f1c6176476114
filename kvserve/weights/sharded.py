"""Read one tensor-parallel rank's slice of each tensor from safetensors files.

safetensors' lazy slices read only the requested bytes of a memory-mapped file, so a rank of an
HF directory or of the GGUF weight cache never holds the other ranks' weights. A GGUF that is
not yet cached is dequantized whole and sliced in memory (its quantized blocks run along rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from kvserve.distributed.sharding import ShardRule, take_shard
from kvserve.errors import CorruptModelFileError


def iter_sharded_safetensors(files: Iterable[Path], rule_for: Callable[[str], ShardRule | None],
                             keep: Callable[[str], bool] | None = None
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) for every tensor of the files that `keep` accepts (a pipeline
    stage's own: the others are never read); replicated tensors whole."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if keep is not None and not keep(name):
                        continue
                    rule = rule_for(name)
                    if rule is None:
                        yield name, handle.get_tensor(name)
                    else:
                        yield name, take_shard(handle.get_slice(name), rule)
        except (OSError, ValueError) as exc:
            raise CorruptModelFileError(f"Cannot read {file}: {exc}") from exc


def shard_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                  rule_for: Callable[[str], ShardRule | None]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The same slices from tensors already in memory (a freshly dequantized GGUF)."""
    for name, tensor in tensors:
        yield name, take_shard(tensor, rule_for(name))
