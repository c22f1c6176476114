"""The decode stack (the decoder layers as one C++ call, kvserve/models/decode_stack.py) against
the Python fused path it replaces: the same ops in the same order, so logits equal to the bit at
every decode step, in every projection kind the stack runs; steps it does not take (long fresh
prompts in float32) fall back to Python; `--enforce-eager` turns it off end to end."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models import random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.testing.tiny import tiny_config
from tests.helpers import decode_logits

MODES = [("float32", "none"), ("float32", "int4"), ("float32", "w4a8"), ("bfloat16", "none"),
         ("bfloat16", "int4"), ("bfloat16", "w4a8")]


@pytest.mark.parametrize("dtype,quantization", MODES)
@pytest.mark.parametrize("windows", [None, (None, 7)])
def test_stack_equals_the_python_path_bit_for_bit(dtype, quantization, windows, isa_level):
    config = tiny_config(**({"sliding_windows": windows} if windows else {}))
    model = random_model(config, dtype, seed=4, attention_backend="paged",
                         quantization=quantization)
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((3, 11, 20))]
    stacked = decode_logits(model, prompts, steps=12, eager=False)
    ops = model.model.ops
    if quantization == "none" or ops.int4_linear_fast():  # torch's int4 kernel: not stacked
        assert type(model.model._decode_stack).__name__ == "DecodeStack"  # it did run
    eager = decode_logits(model, prompts, steps=12, eager=True)
    assert torch.equal(stacked, eager)


def test_bf16_chunks_take_the_stack_on_the_flash_kernel(monkeypatch, isa_level):
    """In bfloat16 over a bf16 cache, sequences of 4 or more new tokens (a verification of
    drafts, a prompt) take the flash kernel inside the stack, as the Python path plans them: a
    fresh prompt and chunks over a cached prefix run in one C++ call, with the Python path's
    logits to the bit. Measured at 600 tokens of context (Zen 4, SmolLM2's heads): 9 new tokens
    1.8 ms of attention a step on flash against 3.0 on the paged kernel."""
    config = tiny_config(head_dim=64)  # a head size the flash kernel takes
    model = random_model(config, "bfloat16", seed=2, attention_backend="paged",
                         quantization="int4")
    inner = model.model
    if not inner.ops.flash_attention_supported(config.head_dim):
        pytest.skip("no flash kernel at this ISA level: every sequence is paged")
    taken = []
    stack_for = inner._stack_for
    monkeypatch.setattr(inner, "_stack_for",
                        lambda *args: taken.append(stack_for(*args) is not None) or
                        stack_for(*args))
    prompt = [(3 * j) % 300 + 5 for j in range(20)]
    results = {}
    for eager in (False, True):
        inner.enforce_eager = eager
        loop = PagedLoop(model, 1, 64)
        first = loop.step([prompt], [20], [0])[0]
        results[eager] = [first] + [
            loop.step([list(range(40, 40 + n))], [20 + n_seen + n], [0], all_logits=True)[0]
            for n_seen, n in ((0, 2), (2, 9), (11, 16))]
    assert taken[:4] == [True, True, True, True]  # the prompt, 2, 9 and 16 new tokens
    for stacked, eager in zip(results[False], results[True]):
        assert torch.equal(stacked, eager)


def test_long_fresh_prompts_take_the_python_path():
    """A float32 prompt over 128 tokens is attended by SDPA (plan.fresh), not the paged kernel:
    that step runs in Python, the decode steps after it in the stack."""
    model = random_model(tiny_config(), "float32", seed=1, attention_backend="paged")
    prompt = [(5 * j) % 300 + 5 for j in range(150)]
    stacked = decode_logits(model, [prompt], steps=4, eager=False, max_len=192)
    assert type(model.model._decode_stack).__name__ == "DecodeStack"
    assert torch.equal(stacked, decode_logits(model, [prompt], steps=4, eager=True, max_len=192))


def test_enforce_eager_gives_the_same_greedy_tokens(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["the quick brown fox", "a b c d e f g"]
    texts = []
    for eager in (False, True):
        llm = LLM(model=str(tiny_model_dir), engine_core="thread", enforce_eager=eager)
        texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        runner_model = llm.llm_engine.engine_core.runner.model.model
        assert runner_model.enforce_eager is eager
        llm.shutdown()
    assert texts[0] == texts[1]
