"""A block-scaled fp8 checkpoint made from a float one, as DeepSeek-V3's and Qwen3-FP8's are
laid out (tests/test_fp8_weights.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

import json
import shutil

import torch

from kvserve.weights.fp8_checkpoint import quantize_fp8_blocks


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's fp8 checkpoints quantize: every projection in the decoder layers (the
    router, norms, embedding and LM head stay float)."""
    return tensor.dim() == 2 and name.startswith("model.layers.") and \
        not name.endswith("mlp.gate.weight")


def write_fp8_checkpoint(source, target, block=(128, 128), drop_scale: str | None = None,
                         bad_scale: str | None = None, keep_float: str = "") -> None:
    """`source`'s float checkpoint as a block-scaled fp8 one in `target` (optionally with one
    scale missing or of the wrong shape, or the projections named with `keep_float` left
    float)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        file.unlink()
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not _is_quantized(name, tensor) or (keep_float and keep_float in name):
            tensors[name] = tensor
            continue
        fp8 = quantize_fp8_blocks(tensor, block, name)
        tensors[name] = fp8.codes
        scale = fp8.scale_inv
        if name == bad_scale:
            scale = scale[:, :-1].contiguous()
        if name != drop_scale:
            tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config))
