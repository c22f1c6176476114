"""A GGUF reader for what the loaders need: the metadata as Python values and each tensor's
name, type, shape and bytes (a view of one memory map).

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every metadata value, so a
262,144-token vocabulary (Gemma 3) took ~21 s to open, before any tensor was read, and each load
opened the file twice (config, tokenizer). Here string arrays are read in one Python loop over
the mapped bytes, numeric arrays with one `np.frombuffer`. The layout (GGUF v2/v3): magic, version,
tensor count, metadata count, the metadata (key, type, value), the tensor infos (name, dims
innermost first, type, offset), then the tensor data from the next multiple of
`general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor as the gguf package's reader gives it: `shape` innermost first; `data` in
    the array shape `gguf.quants.dequantize` takes (floats for F16/F32, bytes per row for
    block-quantized types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    start: int = 0  # where its bytes lie in the file
    nbytes: int = 0


class GGUFFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        self._offset = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self._offset = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    # ---- the metadata section

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        end = self._offset + length
        if end > len(self._buffer):
            raise ValueError("string runs past the end of the file")
        text = bytes(self._buffer[self._offset:end]).decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _strings(self, count: int) -> list[str]:
        """A string array (a vocabulary, merges: ~350,000 strings for Llama 3) in one tight
        loop, decoded straight from the map."""
        buffer, offset, size = self._buffer, self._offset, len(self._buffer)
        length_of = struct.Struct("<Q").unpack_from
        strings = []
        for _ in range(count):
            (length,) = length_of(buffer, offset)
            offset += 8
            if offset + length > size:
                raise ValueError("string runs past the end of the file")
            strings.append(str(buffer[offset:offset + length], "utf-8", "replace"))
            offset += length
        self._offset = offset
        return strings

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind])
                values = np.frombuffer(self._buffer, dtype=dtype, count=count,
                                       offset=self._offset)
                self._offset += dtype.itemsize * count
                return values.tolist()
            if item_kind == _STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata type {kind}")

    # ---- the tensor infos and data

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], kind: int,
                offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(kind)
        shape = tuple(reversed(dims))  # outermost first, as numpy wants
        elements = int(np.prod(dims, dtype=np.int64))
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        start = data_start + offset
        if qtype in plain:
            dtype = np.dtype(plain[qtype])
            nbytes = elements * dtype.itemsize
        else:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            nbytes = elements // block * block_bytes
        if start + nbytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        raw = self._map[start:start + nbytes]
        if qtype in plain:
            data = raw.view(dtype).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name, qtype, dims, data, start, nbytes)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop this process's mapping of a tensor's pages once it has been copied out
        (packed or converted): they stay in the page cache, and a later read of the tensor
        maps them again. Without this a load's peak memory counted every page of the file on
        top of the packed weights (the whole file's size more, e.g. 2 GB for a 3B Q4_K_M)."""
        page = mmap.PAGESIZE
        first = tensor.start // page * page
        end = tensor.start + tensor.nbytes
        handle = getattr(self._map, "_mmap", None)
        if handle is None or end <= first or not hasattr(handle, "madvise"):
            return
        handle.madvise(mmap.MADV_DONTNEED, first, end - first)
