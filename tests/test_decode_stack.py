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

MODES = [("float32", "none"), ("float32", "int4"), ("float32", "w4a8"), ("bfloat16", "none"),
         ("bfloat16", "int4")]


def _decode_logits(model, prompts, steps, eager: bool, max_len: int = 96):
    """Greedy decode of every prompt together; the logits of each step, stacked."""
    model.model.enforce_eager = eager
    loop = PagedLoop(model, len(prompts), max_len)
    lengths = [len(p) for p in prompts]
    logits = loop.step(prompts, lengths, list(range(len(prompts))))
    seen = [torch.stack(logits)]
    for _ in range(steps):
        tokens = [[int(row.argmax())] for row in logits]
        lengths = [n + 1 for n in lengths]
        logits = loop.step(tokens, lengths, list(range(len(prompts))))
        seen.append(torch.stack(logits))
    return torch.stack(seen)


@pytest.mark.parametrize("dtype,quantization", MODES)
@pytest.mark.parametrize("windows", [None, (None, 7)])
def test_stack_equals_the_python_path_bit_for_bit(dtype, quantization, windows, isa_level):
    config = tiny_config(**({"sliding_windows": windows} if windows else {}))
    model = random_model(config, dtype, seed=4, attention_backend="paged",
                         quantization=quantization)
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((3, 11, 20))]
    stacked = _decode_logits(model, prompts, steps=12, eager=False)
    ops = model.model.ops
    if quantization == "none" or ops.int4_linear_fast():  # torch's int4 kernel: not stacked
        assert type(model.model._decode_stack).__name__ == "DecodeStack"  # it did run
    eager = _decode_logits(model, prompts, steps=12, eager=True)
    assert torch.equal(stacked, eager)


def test_long_fresh_prompts_take_the_python_path():
    """A float32 prompt over 128 tokens is attended by SDPA (plan.fresh), not the paged kernel:
    that step runs in Python, the decode steps after it in the stack."""
    model = random_model(tiny_config(), "float32", seed=1, attention_backend="paged")
    prompt = [(5 * j) % 300 + 5 for j in range(150)]
    stacked = _decode_logits(model, [prompt], steps=4, eager=False, max_len=192)
    assert type(model.model._decode_stack).__name__ == "DecodeStack"
    assert torch.equal(stacked, _decode_logits(model, [prompt], steps=4, eager=True, max_len=192))


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
