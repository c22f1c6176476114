"""Block-scaled fp8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8): each quantized projection's weight
is float8_e4m3fn codes [rows, cols] beside `<name>_scale_inv`, one float32 per block of
`weight_block_size` (rows, cols) values, the block's value = code * scale_inv (the ragged last
blocks of a dimension that is not a multiple of the block included).

`iter_fp8_checkpoint` pairs every fp8 weight with its scales, wherever the shards put them, and
hands the pair on as an `Fp8Weight`: what a layer does with it (keep it as 8-bit codes, or take
its exact float values) is the quantization policy's choice (quant/fp8.py). A weight whose scale
tensor is missing or does not have one scale per block fails here, naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from kvserve.errors import CorruptModelFileError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_SUFFIX = "_scale_inv"


@dataclass
class Fp8Weight:
    """One projection's fp8 codes and block scales, as the checkpoint stores them."""

    codes: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale_inv: torch.Tensor  # float32 [ceil(rows / block rows), ceil(cols / block cols)]
    block: tuple[int, int]
    name: str = ""

    def __post_init__(self):
        rows, cols = self.codes.shape
        expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        if tuple(self.scale_inv.shape) != expected:
            raise CorruptModelFileError(
                f"checkpoint tensor {self.name + SCALE_SUFFIX!r} has shape "
                f"{list(self.scale_inv.shape)}; {self.name!r} [{rows}, {cols}] in blocks of "
                f"{list(self.block)} needs {list(expected)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: every code times its block's scale (exact: an e4m3 value
        times a float32 scale rounds once, as every reference dequantizes it)."""
        return self.codes.float() * expand_block_scales(self.scale_inv, self.block,
                                                        self.codes.shape)


def expand_block_scales(scales: torch.Tensor, block: tuple[int, int],
                        shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Per-block scales [R, C] as one scale per value [rows, cols]."""
    rows, cols = shape
    return scales.float().repeat_interleave(block[0], 0)[:rows] \
        .repeat_interleave(block[1], 1)[:, :cols]


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                        name: str = "") -> Fp8Weight:
    """A float weight [rows, cols] as fp8 codes with one scale per block: scale = block absmax
    / 448, codes = value / scale rounded to e4m3 (to nearest even); an all-zero block gets
    scale 1 (its codes are 0). What DeepSeek's and Qwen's fp8 checkpoints hold,
    and what `--quantization fp8` makes of a float checkpoint."""
    values = weight.float()
    rows, cols = values.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = values
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    absmax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    codes = (values / expand_block_scales(scale, block, (rows, cols))).to(FP8_DTYPE)
    return Fp8Weight(codes, scale, tuple(block), name)


def tensor_dtypes(files: Iterable[Path]) -> dict[str, str]:
    """Every tensor's dtype by name as safetensors names it ("F8_E4M3", "BF16", ...), from the
    headers alone."""
    from safetensors import safe_open

    types = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                types[name] = handle.get_slice(name).get_dtype()
    return types


def iter_fp8_checkpoint(files: list[Path], block: tuple[int, int]
                        ) -> Iterator[tuple[str, object]]:
    """(name, tensor) of a block-scaled fp8 checkpoint: fp8 weights as `Fp8Weight`s (their
    scales read beside them, from whichever shard holds them), the scales themselves not again,
    everything else as stored."""
    from safetensors import SafetensorError, safe_open

    homes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            homes.update((name, file) for name in handle.keys())
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in homes:
                        continue
                    tensor = handle.get_tensor(name)
                    if tensor.dtype == FP8_DTYPE:
                        tensor = Fp8Weight(tensor, _scales(homes, name), block, name)
                    yield name, tensor
        except (OSError, ValueError, SafetensorError) as exc:
            raise CorruptModelFileError(f"Cannot read {file}: {exc}") from exc


def _scales(homes: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    scale_name = name + SCALE_SUFFIX
    if scale_name not in homes:
        raise CorruptModelFileError(
            f"checkpoint tensor {name!r} is fp8 but the checkpoint has no {scale_name!r} (its "
            "block scales): the file is incomplete or not a block-scaled fp8 checkpoint")
    with safe_open(str(homes[scale_name]), framework="pt") as handle:
        return handle.get_tensor(scale_name).float()
