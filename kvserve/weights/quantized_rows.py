"""A GGUF tensor's rows as the file stores them: `QuantizedRows` is a block-quantized weight
[rows, cols] held as its file bytes (uint8 [rows, row_bytes] of `qtype` blocks), so that the
model's loaders can take rows (a tensor-parallel rank's, llama.cpp's Q/K permutation undone,
partial rotary's head order) and block-aligned columns (a row-parallel rank's) without ever
dequantizing, and hand the bytes to the kernels' packers (kernels: `gguf_pack`).

It answers the indexing `distributed.sharding.take_shard` and the linear layers use: rows by a
slice or an index tensor, columns by a slice at block boundaries, `cat`, `new_zeros`.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kvserve.errors import CorruptModelFileError


class QuantizedRows:
    def __init__(self, qtype: str, data: np.ndarray | torch.Tensor, cols: int, block: int,
                 name: str = ""):
        """`data`: uint8 [rows, row_bytes]; `block`: values per block along a row."""
        self.qtype, self.cols, self.block, self.name = qtype, cols, block, name
        self.data = data
        if cols % block or not cols or data.shape[1] % (cols // block):
            raise CorruptModelFileError(
                f"tensor {name!r} ({qtype}): {data.shape[1]} bytes a row do not hold {cols} "
                f"values in blocks of {block}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    @property
    def block_bytes(self) -> int:
        return int(self.data.shape[1]) // (self.cols // self.block)

    def _like(self, data, cols: int | None = None) -> "QuantizedRows":
        return QuantizedRows(self.qtype, data, self.cols if cols is None else cols, self.block,
                             self.name)

    def __getitem__(self, index) -> "QuantizedRows":
        """Rows (a slice or an int64 index tensor), or (all rows, a column slice on block
        boundaries)."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, tuple):
            rows, columns = index
            if rows != slice(None):
                return self[rows][:, columns]
            return self._columns(columns)
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        return self._like(self.data[index])

    def _columns(self, columns: slice) -> "QuantizedRows":
        start, stop, _ = columns.indices(self.cols)
        if start % self.block or stop % self.block:
            raise ValueError(
                f"tensor {self.name!r} ({self.qtype}, blocks of {self.block}): columns "
                f"{start}:{stop} do not fall on block boundaries; a tensor-parallel size that "
                f"splits its {self.cols} inputs into multiples of {self.block} is needed")
        first, end = start // self.block, stop // self.block
        size = self.block_bytes
        return self._like(self.data[:, first * size:end * size], stop - start)

    def new_zeros(self, shape) -> "QuantizedRows":
        """Zero blocks (a zero scale: every value 0), e.g. a vocabulary shard's padding rows."""
        rows = shape[0]
        return self._like(np.zeros((rows, self.data.shape[1]), dtype=np.uint8))

    @staticmethod
    def cat(pieces: list["QuantizedRows"], dim: int = 0) -> "QuantizedRows":
        if dim != 0:
            raise ValueError("quantized rows join along rows only")
        first = pieces[0]
        return first._like(np.concatenate([np.asarray(p.data) for p in pieces]))

    def bytes(self) -> torch.Tensor:
        """The rows' bytes as a contiguous uint8 tensor, for reading only: a view of the
        file's memory map where the rows lie contiguous in it (a whole tensor, a slice of
        rows), else a copy."""
        data = self.data
        if isinstance(data, torch.Tensor):
            return data.contiguous()
        if not data.flags.c_contiguous:
            return torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
        with warnings.catch_warnings():  # the map is read-only; nothing writes through this
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.asarray(data, dtype=np.uint8))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: gguf's own dequantization of these blocks."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(np.asarray(self.data), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)
                                .reshape(self.shape))

    def __repr__(self) -> str:
        return f"QuantizedRows({self.name!r}, {self.qtype}, shape={self.shape})"
