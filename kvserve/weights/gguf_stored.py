"""A GGUF's tensors for loading as the file stores them: block-quantized ones as `QuantizedRows`
(never dequantized here), float ones as torch tensors, under HF's names and in HF's row order
(weights/gguf_file.py keeps the metadata and names, and no torch, for the router's tokenizer)."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedQuantizationError
from kvserve.weights.gguf_file import (
    dequantize_tensor,
    hf_tensor_name,
    permuted_heads,
    unpermute_rope_rows,
)
from kvserve.weights.quantized_rows import QuantizedRows


def iter_gguf_stored(reader, config: ModelConfig) -> Iterator[tuple[str, object]]:
    """Yield (HF name, tensor in HF layout) for every tensor the model uses, block-quantized
    ones as the file stores them (`QuantizedRows`, its rows in HF's order: llama.cpp's Q/K
    permutation undone by moving whole rows), float ones as float32 torch tensors. Gemma's
    converter stores each norm as 1 + weight (llama.cpp multiplies by it directly); HF's
    weight is that minus 1, as its GGUF loader computes it."""
    consumed = _PageRelease(reader)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config.architecture)
        if name is None:
            continue
        consumed.entering(tensor)
        if "{}" in name:  # every expert's, [experts, rows, cols]: one tensor each
            yield from _per_expert(name, _as_loaded(tensor, name, config),
                                   int(tensor.shape[-1]))  # GGUF lists dims innermost first
            continue
        yield name, _as_loaded(tensor, name, config)
    consumed.entering(None)


def _as_loaded(tensor, name: str, config: ModelConfig):
    """A float tensor as float32 torch (Q/K rows unpermuted, Gemma's norms less 1), a block-
    quantized one as its QuantizedRows (rows moved the same way)."""
    heads = permuted_heads(name, config)
    if tensor.tensor_type.name in ("F32", "F16", "BF16"):
        array = dequantize_tensor(tensor)
        if heads:
            array = unpermute_rope_rows(array, heads)
        if config.norm_weight_offset and name.endswith("norm.weight"):
            array = array - np.float32(config.norm_weight_offset)
        return torch.from_numpy(np.array(array, dtype=np.float32))
    _check_readable(tensor)
    rows = QuantizedRows(tensor.tensor_type.name, _rows_bytes(tensor),
                         int(tensor.shape[0]), _block_elements(tensor), tensor.name)
    if heads:
        rows = rows[torch.from_numpy(unpermute_rope_rows(
            np.arange(rows.shape[0])[:, None], heads)[:, 0])]
    return rows


def _per_expert(name: str, whole, experts: int) -> Iterator[tuple[str, object]]:
    """An experts tensor's experts: float [E, rows, cols] by index; QuantizedRows (E * rows
    rows, expert-major) by their runs of rows."""
    rows = whole.shape[0] // experts
    for expert in range(experts):
        if isinstance(whole, torch.Tensor):
            yield name.format(expert), whole[expert]
            continue
        part = whole[expert * rows:(expert + 1) * rows]
        part.name = f"{whole.name}[{expert}]"  # its own identity (the packed-panel cache's key)
        yield name.format(expert), part


class _PageRelease:
    """Drops the file's pages of a layer's tensors once the next layer's first tensor is read:
    by then the layer's projections have packed (or converted) every part they staged, so a
    load's peak memory holds one layer of the file beside the packed weights, not all of it."""

    def __init__(self, reader):
        self.reader, self.block, self.held = reader, None, []

    def entering(self, tensor) -> None:
        block = None if tensor is None else tensor.name.split(".")[:2]  # "blk.N", or a name
        if tensor is None or block != self.block:
            for held in self.held:
                self.reader.release(held)
            self.held, self.block = [], block
        if tensor is not None:
            self.held.append(tensor)


def _check_readable(tensor) -> None:
    """A block type neither our kernels nor the gguf package can read is an error naming the
    tensor, before any of it is used."""
    from gguf import GGML_QUANT_SIZES, quants

    from kvserve.kernels.reference import GGUF_FORMATS

    if tensor.tensor_type.name in GGUF_FORMATS:
        return
    block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
    try:  # one block: the package raises NotImplementedError for a type it cannot read
        quants.dequantize(np.asarray(tensor.data).reshape(-1)[:block_bytes], tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedQuantizationError(
            f"Tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which neither "
            "kvserve's kernels nor the gguf package can read. Re-quantize the model to one of "
            "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K or an IQ type.") from exc


def tensor_types(reader, config: ModelConfig) -> dict[str, str]:
    """HF name -> how the file stores it (a GGMLQuantizationType name), for the tensors the
    model uses (each expert's of an experts tensor): what each projection's method is chosen
    from."""
    types = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config.architecture)
        if name is None:
            continue
        names = [name.format(e) for e in range(int(tensor.shape[-1]))] if "{}" in name \
            else [name]
        types.update(dict.fromkeys(names, tensor.tensor_type.name))
    return types


def _block_elements(tensor) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[tensor.tensor_type][0]


def _rows_bytes(tensor) -> np.ndarray:
    """A block-quantized tensor's bytes as rows (a view of the memory map): [rows, row bytes]
    for a 2-D weight."""
    data = tensor.data
    rows = int(np.prod(tensor.shape[1:], dtype=np.int64))
    return data.reshape(rows, -1)


