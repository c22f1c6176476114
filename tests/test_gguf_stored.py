"""A GGUF served in its own block types (`--quantization gguf`, what `auto` picks for one): a
tiny Llama stored as a Q4_K_M file stores a model (Q4_K projections, Q6_K values and down
projections, a Q8_0 tied embedding, or a Q6_K output and a Q4_K embedding untied) against the same
file dequantized by the gguf package into a float32 model.

The weights are the file's numbers to the bit; prompts past the integer kernels' row limit (the
dequantized GEMM) give the float model's logits within 1e-3; decode rows, whose activations the
integer-dot kernels round to int8 per group of 32 (as llama.cpp does), and prompt rows, which
the K-quant projections round per super-block of 256 (as llama.cpp's Q8_K), give the float
model's logits with its projections' inputs rounded the same way, within 1e-3; the decode
stack, which runs the value projection's second block type beside the first, equals the Python
loop to the bit."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.models.paged_loop import PagedLoop
from tests.helpers import kernel_level, write_q4_k_m

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]
# float sums in another order (kernels, levels), on logits up to ~20: measured up to 3e-4 (the
# scalar build), as test_hf_parity's bound for SmolLM2
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=[True, False], ids=["tied-q8_0", "untied-q6_k"])
def checkpoint(request, tmp_path_factory):
    path = write_q4_k_m(tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf", request.param)
    reference, _ = load_model(resolve_model(path), "float32", attention_backend="torch_ref",
                              quantization="none")
    return path, reference


def _stored(path, attention_backend="paged"):
    model, _ = load_model(resolve_model(path), "float32", attention_backend=attention_backend,
                          quantization="gguf")
    return model


def test_the_layers_hold_the_files_numbers_to_the_bit(checkpoint):
    path, reference = checkpoint
    model = _stored(path)
    ops = model.kernel_ops
    assert model.quantization == "gguf"
    held = {name: module.impl for name, module in model.named_modules()
            if hasattr(module, "method")}  # the projections
    held["model.embed_tokens"] = model.model.embed_tokens.stored
    if not model.lm_head.tied:
        held["lm_head"] = model.lm_head.impl
    for name, impl in held.items():
        assert type(impl).__name__ == "StoredLinear", name
        expected = dict(reference.named_modules())[name].weight
        rows = [ops.gguf_dequantize(s.panels, s.qtype, range(s.rows), impl.in_features,
                                    torch.float32) for s in impl.segments]
        assert torch.equal(torch.cat(rows), expected), name
    assert [s.qtype for s in model.model.layers[0].self_attn.qkv_proj.impl.segments] == \
        ["Q4_K", "Q6_K"]
    # no float copy of any projection: the layers hold their norms' weights only
    assert {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters()} <= {
        "input_layernorm", "post_attention_layernorm", "norm"}


def test_prompt_logits_equal_the_dequantized_file(checkpoint, isa_level):
    """Prefill past the integer-dot kernels' row limit (here every call: limit 0) runs the
    file's blocks dequantized, exactly."""
    path, reference = checkpoint
    model = _stored(path)
    for module in model.modules():
        if type(module).__name__ == "StoredLinear":
            module.max_rows = 0
    expected = PagedLoop(reference, 1, 64).step([PROMPT], [len(PROMPT)], [0], all_logits=True)
    got = PagedLoop(model, 1, 64).step([PROMPT], [len(PROMPT)], [0], all_logits=True)
    assert (got[0] - expected[0]).abs().max() < LOGIT_TOLERANCE


def _stored_types(model) -> dict[str, set[str]]:
    """Each projection's (and the LM head's) block types, by module name."""
    types = {name: {s.qtype for s in module.impl.segments}
             for name, module in model.named_modules() if hasattr(module, "method")}
    head = model.model.embed_tokens.stored if model.lm_head.tied else model.lm_head.impl
    types["lm_head"] = {s.qtype for s in head.segments}
    return types


def _rounding_activations(model, types: dict[str, set[str]], superblocks: bool = True):
    """The float model with each projection's and the LM head's input rounded as the stored
    kernels round it in the calls they serve (kernels/reference.py's gguf_linear_int): per
    super-block of 256 for a K-quant call of SUPERBLOCK_MIN_ROWS rows or more (`superblocks`:
    the switch), else per group of 32."""
    from kvserve.kernels.reference import (SUPERBLOCK_MIN_ROWS, SUPERBLOCK_TYPES,
                                           quantize_activations_q8, quantize_activations_q8k)
    from kvserve.quant.stored import STORED_KERNEL_MAX_ROWS

    def rounded(forward, k_quants: bool):
        def run(x):
            if x.shape[0] > STORED_KERNEL_MAX_ROWS:
                return forward(x)
            wide = superblocks and k_quants and x.shape[0] >= SUPERBLOCK_MIN_ROWS
            rounding = quantize_activations_q8k if wide else quantize_activations_q8
            return forward(rounding(x).to(x.dtype))
        return run

    for name, module in model.named_modules():
        if name in types:
            k_quants = types[name] <= set(SUPERBLOCK_TYPES)
            assert k_quants or not types[name] & set(SUPERBLOCK_TYPES), name
            module.forward = rounded(module.forward, k_quants)
    return model


def test_decode_rows_are_the_files_weights_times_rounded_activations(checkpoint, tmp_path):
    """One token at a time (the integer-dot kernels): the float model of the same file, with
    every projection's input rounded to int8 per group of 32 the same way (the 8-token prompt
    before them: per super-block for the K-quants, as the kernels round it)."""
    path, _ = checkpoint
    model = _stored(path)
    # the same attention kernel, and the Python layers (the decode stack would skip the
    # rounding): an int8 code is a step function, so another attention's float sums (1e-4 off,
    # as torch_ref's on Zen 5) can flip a code of the LM head's input and move logits by 0.06
    reference, _ = load_model(resolve_model(path), "float32", attention_backend="paged",
                              quantization="none")
    reference.model.enforce_eager = True
    reference = _rounding_activations(reference, _stored_types(model))
    loops = PagedLoop(model, 1, 64), PagedLoop(reference, 1, 64)
    for loop in loops:
        loop.step([PROMPT[:8]], [8], [0])
    for n, token in enumerate(PROMPT[8:20], start=9):
        got, expected = (loop.step([[token]], [n], [0])[0] for loop in loops)
        assert (got - expected).abs().max() < LOGIT_TOLERANCE


def test_prompt_rows_are_the_files_weights_times_activations_rounded_per_superblock(
        checkpoint, isa_level):
    """A prompt of 12 rows (the integer-dot kernels, autotuner off) rounds the K-quant
    projections' inputs at one step per super-block of 256 (llama.cpp's Q8_K: gguf_linear_int)
    and the others' (a Q8_0 tied head) per group of 32: the float model of the same file with
    each projection's input rounded that way; with the switch off, every one per 32. Few rows:
    an int8 code is a step function, and over 40 rows the float model's own sums (1e-6 off)
    flipped a code of this random model and moved a row's logits by 0.06-0.24."""
    prompt = PROMPT[:12]
    path, _ = checkpoint
    model = _stored(path)
    ops = model.kernel_ops
    for superblocks in (True, False):
        reference, _ = load_model(resolve_model(path), "float32", attention_backend="paged",
                                  quantization="none")
        reference.model.enforce_eager = True
        reference = _rounding_activations(reference, _stored_types(model), superblocks)
        ops.set_gguf_superblocks(superblocks)
        try:
            got = PagedLoop(model, 1, 64).step([prompt], [len(prompt)], [0], all_logits=True)
        finally:
            ops.set_gguf_superblocks(True)
        expected = PagedLoop(reference, 1, 64).step([prompt], [len(prompt)], [0],
                                                    all_logits=True)
        assert (got[0] - expected[0]).abs().max() < LOGIT_TOLERANCE, superblocks


def test_decode_stack_equals_the_python_loop(checkpoint, isa_level):
    path, _ = checkpoint
    model = _stored(path)
    outputs = {}
    for eager in (False, True):
        model.model.enforce_eager = eager
        model.model.reset_decode_stack()
        outputs[eager] = torch.stack(PagedLoop(model, 2, 64).step(
            [PROMPT[:5], PROMPT[5:8]], [5, 3], [0, 1]))
        loop = PagedLoop(model, 2, 64)
        loop.step([PROMPT[:5], PROMPT[5:8]], [5, 3], [0, 1])
        outputs[eager] = torch.stack(loop.step([[9], [11]], [6, 4], [0, 1]))
        if not eager and model.kernel_ops.compiled:
            assert type(model.model._decode_stack).__name__ == "DecodeStack"
    assert torch.equal(outputs[False], outputs[True])


def test_auto_keeps_a_gguf_in_its_block_types(checkpoint):
    path, _ = checkpoint
    with kernel_level("avx2"):
        model, _ = load_model(resolve_model(path), "float32", attention_backend="paged",
                              quantization="auto", dtype_is_default=True)
    assert model.quantization == "gguf"
    model, _ = load_model(resolve_model(path), "float32", quantization="auto")
    assert model.quantization == "none"  # float32 asked for: the exact reference


def test_untuned_shapes_leave_large_batches_to_the_integer_kernel_without_amx_tiles():
    """Before the autotuner has measured a shape, the dequantizing path takes batches over 64
    rows only where it has AMX tiles (bfloat16): elsewhere its GEMM is the slower one."""
    from kvserve.kernels import autotune
    from kvserve.quant.stored import STORED_KERNEL_MAX_ROWS, untuned_max_rows

    class Kernels:
        def __init__(self, amx: bool):
            self.gguf_amx_usable = lambda: amx

    assert untuned_max_rows(Kernels(True), torch.bfloat16) == STORED_KERNEL_MAX_ROWS
    assert untuned_max_rows(Kernels(True), torch.float32) == autotune.NO_LIMIT
    assert untuned_max_rows(Kernels(False), torch.bfloat16) == autotune.NO_LIMIT
    assert untuned_max_rows(object(), torch.bfloat16) == autotune.NO_LIMIT  # the torch ops
