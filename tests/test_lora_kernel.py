"""The grouped LoRA kernel (`lora_add_`, kernels/csrc/lora.cpp) at every instruction-set level
this machine can execute, against the torch reference (kernels/reference.py): rows of several
adapters and of none, interleaved in any order, float32 and bf16, ranks and widths that are and
are not multiples of the vector width, a slot out of range refused."""

import pytest
import torch

from kvserve.kernels import reference


def _case(rows, k, n, slots_count, width, dtype, weight_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    out = torch.randn(rows, n, generator=generator).to(dtype)
    a = (torch.randn(slots_count, width, k, generator=generator) / k**0.5).to(weight_dtype)
    b = torch.randn(slots_count, width, n, generator=generator).to(weight_dtype)
    slots = torch.randint(-1, slots_count, (rows,), generator=generator, dtype=torch.int32)
    return x, out, a, b, slots


@pytest.mark.parametrize("rows,k,n,width", [(1, 64, 96, 16), (7, 100, 37, 5),
                                            (33, 576, 960, 48), (130, 48, 64, 8)])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
def test_grouped_lora_equals_the_reference(kernels, rows, k, n, width, dtype, weight_dtype):
    x, out, a, b, slots = _case(rows, k, n, 4, width, dtype, weight_dtype)
    expected = out.clone()
    reference.lora_add_(x, expected, a, b, slots)
    kernels.lora_add_(x, out, a, b, slots)
    base = slots < 0
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # sums of ~600 terms
    else:  # the same float32 sum, rounded once to bf16: at most one bf16 step apart
        torch.testing.assert_close(out.float(), expected.float(), rtol=8e-3, atol=8e-3)
    assert torch.equal(out[base], _case(rows, k, n, 4, width, dtype, weight_dtype)[1][base])


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
def test_long_runs_of_one_adapter_through_gemms(kernels, dtype, weight_dtype):
    """Runs of more than gemm_rows consecutive rows of one slot (a prompt's chunk) take two
    GEMMs, the rest the tiles: the reference's sums (bf16: the GEMMs round the [rows, W]
    product once, as PEFT's bf16 layers do), the base rows untouched, whatever the limit."""
    x, out, a, b, _ = _case(90, 576, 160, 3, 48, dtype, weight_dtype, seed=2)
    slots = torch.tensor([0] * 40 + [1] * 3 + [-1] * 5 + [2] * 20 + [0] * 2 + [1] * 20,
                         dtype=torch.int32)
    expected = out.clone()
    reference.lora_add_(x, expected, a, b, slots)
    for gemm_rows in (0, 10, 20, 1 << 30):
        got = _case(90, 576, 160, 3, 48, dtype, weight_dtype, seed=2)[1]
        kernels.lora_add_(x, got, a, b, slots, gemm_rows)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        else:  # the [rows, 48] product rounded to bf16 (2^-9 relative) times B's ~N(0, 1)
            # values summed over 48: ~0.05 at most, beside out's own rounding (values ~10)
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=0.1)
        assert torch.equal(got[43:48], out[43:48])


def test_base_rows_only_and_a_view_input(kernels):
    x, out, a, b, _ = _case(5, 64, 32, 2, 16, torch.float32, torch.float32)
    before = out.clone()
    kernels.lora_add_(x, out, a, b, torch.full((5,), -1, dtype=torch.int32))
    assert torch.equal(out, before)
    wide = torch.randn(5, 128)
    view = wide[:, ::2]  # a projection's input may be a strided view
    slots = torch.tensor([1, 0, 1, -1, 0], dtype=torch.int32)
    expected = out.clone()
    reference.lora_add_(view, expected, a, b, slots)
    kernels.lora_add_(view, out, a, b, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_slot_out_of_range_is_refused(kernels):
    x, out, a, b, _ = _case(3, 64, 32, 2, 16, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="slot 2 of 2"):
        kernels.lora_add_(x, out, a, b, torch.tensor([0, 2, -1], dtype=torch.int32))


def _random_adapters(model, ids, rank: int = 8) -> None:
    """Random adapters on every projection, loaded into the model's slots as `ids`."""
    from kvserve.models.lora import LoRAAdapter
    from kvserve.models.lora.model_lora import lora_targets

    generator = torch.Generator().manual_seed(5)
    for adapter_id in ids:
        weights = {}
        for module, (layer, part) in lora_targets(model).items():
            rows, columns = layer.parts[part].full_rows, layer.full_in_features
            weights[module] = (torch.randn(rank, columns, generator=generator) / columns**0.5,
                               torch.randn(rows, rank, generator=generator) / rank)
        model.lora.add(adapter_id, LoRAAdapter(rank, weights))


@pytest.mark.parametrize("dtype,quantization,gemm_rows", [
    ("float32", "none", None), ("bfloat16", "none", None), ("bfloat16", "int4", None),
    ("bfloat16", "none", 4)])
def test_decode_stack_runs_adapters_as_the_python_loop(monkeypatch, isa_level, dtype,
                                                      quantization, gemm_rows):
    """Steps whose rows run adapters take the decode stack, which adds each projection's
    adapters with the same kernel after the same base product: logits equal to the Python
    loop's to the bit, and not the base model's; also with prompts' runs over the GEMM limit
    (`gemm_rows`, the autotuner's per shape)."""
    from kvserve.models import random_model
    from kvserve.models.lora import ModelLoRA
    from kvserve.models.lora.slots import LinearLoRA
    from kvserve.models.paged_loop import PagedLoop
    from kvserve.testing.tiny import tiny_config
    from tests.helpers import decode_logits

    model = random_model(tiny_config(), dtype, seed=4, attention_backend="paged",
                         quantization=quantization)
    model.lora = ModelLoRA(model, 2, 8, model.activation_dtype)
    _random_adapters(model, (1, 2))
    if gemm_rows is not None:
        for lora in {id(m.lora): m.lora for m in model.modules()
                     if isinstance(getattr(m, "lora", None), LinearLoRA)}.values():
            lora.max_rows = gemm_rows
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((3, 11, 20))]
    adapter_of = {0: 0, 1: 1, 2: 2}  # the first sequence runs the base model
    step = PagedLoop.step

    def step_with_adapters(loop, chunks, seq_lens, seq_ids, all_logits=False):
        spans, start = {}, 0
        for chunk, seq_id in zip(chunks, seq_ids):
            if adapter_of[seq_id]:
                spans.setdefault(adapter_of[seq_id], []).append((start, start + len(chunk)))
            start += len(chunk)
        model.lora.set_rows(spans, start)
        return step(loop, chunks, seq_lens, seq_ids, all_logits)

    monkeypatch.setattr(PagedLoop, "step", step_with_adapters)
    inner = model.model
    taken = []
    stack_for = inner._stack_for
    monkeypatch.setattr(inner, "_stack_for",
                        lambda *args: taken.append(stack_for(*args) is not None) or
                        stack_for(*args))
    stacked = decode_logits(model, prompts, steps=8, eager=False)
    if quantization == "none" or inner.ops.int4_linear_fast():  # torch's int4: not stacked
        assert all(taken[1:]), "a decode step with adapter rows left the stack"
    eager = decode_logits(model, prompts, steps=8, eager=True)
    assert torch.equal(stacked, eager)
    adapter_of.update({1: 0, 2: 0})
    base = decode_logits(model, prompts, steps=0, eager=False)
    assert torch.equal(base[0, 0], stacked[0, 0])  # the base model's row is the base's
    assert not torch.allclose(base[0, 1:], stacked[0, 1:], atol=1e-3)
