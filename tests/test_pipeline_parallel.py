"""Pipeline stages of one model, chained in one process: the stage split (which layers, which
tensors each stage holds) and the hand-over of hidden states and the residual stream give the
unsplit model's logits, on the fused `paged` path and the eager `torch_ref` one, tied and untied
LM heads. The processes and send/recv between them are tested through the engine
(tests/test_executor_mp.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.distributed.parallel_state import ParallelContext
from kvserve.distributed.sharding import (
    PP_LAYER_PARTITION_ENV,
    stage_layer_counts,
    validate_pipeline_parallel,
)
from kvserve.models import random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.testing.tiny import tiny_config

VOCAB = 1000
PROMPTS = [[(13 * i + 5 * j) % (VOCAB - 10) + 5 for j in range(2 + 3 * i)] for i in range(16)]


class ChainedStages:
    """The stage models of one pipeline run back to back, looking like one model to PagedLoop."""

    def __init__(self, stages):
        self.stages = stages
        self.config = stages[0].config

    def parameters(self):
        return self.stages[0].parameters()

    def kv_page_layouts(self, dtype):
        return [layout for stage in self.stages for layout in stage.kv_page_layouts(dtype)]

    def bind_kv_cache(self, caches):
        start = 0
        for stage in self.stages:
            stage.bind_kv_cache(caches[start:start + stage.num_stage_layers])
            start += stage.num_stage_layers

    def __call__(self, input_ids, positions, metadata):
        intermediate = None
        for stage in self.stages:
            out = stage(input_ids, positions, metadata, intermediate)
            # through a packed tensor, as the bytes that cross between processes
            intermediate = None if stage is self.stages[-1] else type(out).unpack(out.pack())
        return out

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden)


def _stages(config, pp: int, backend: str):
    return [random_model(config, "float32", seed=3, attention_backend=backend,
                         parallel=ParallelContext(pp_rank=rank, pp_size=pp))
            for rank in range(pp)]


@pytest.mark.parametrize("backend", ["paged", "torch_ref"])
@pytest.mark.parametrize("pp, tied", [(2, True), (3, False), (5, True)])
def test_chained_stages_give_the_whole_models_logits(backend, pp, tied):
    config = tiny_config(VOCAB, num_hidden_layers=5, tie_word_embeddings=tied)
    whole = random_model(config, "float32", seed=3, attention_backend=backend)
    chained = ChainedStages(_stages(config, pp, backend))
    max_len = max(map(len, PROMPTS)) + 8
    expected = PagedLoop(whole, len(PROMPTS), max_len).greedy(PROMPTS, 6)
    loop = PagedLoop(chained, len(PROMPTS), max_len)
    assert loop.greedy(PROMPTS, 6) == expected
    reference = PagedLoop(whole, len(PROMPTS), max_len)
    lengths = [len(p) for p in PROMPTS]
    a = torch.stack(PagedLoop(chained, len(PROMPTS), max_len).step(
        PROMPTS, lengths, list(range(len(PROMPTS)))))
    b = torch.stack(reference.step(PROMPTS, lengths, list(range(len(PROMPTS)))))
    assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_each_stage_holds_only_its_tensors():
    config = tiny_config(VOCAB, num_hidden_layers=5, tie_word_embeddings=False)
    first, last = _stages(config, 2, "paged")
    names = lambda model: {n for n, _ in model.named_parameters()}  # noqa: E731
    split = first.model.end_layer
    assert "model.embed_tokens.weight" in names(first) and "lm_head.weight" in names(last)
    assert "model.embed_tokens.weight" not in names(last) and "lm_head.weight" not in names(first)
    assert "model.norm.weight" in names(last) and "model.norm.weight" not in names(first)
    assert {n for n in names(first) if ".layers." in n} == {
        n for n in names(random_model(config, "float32")) if ".layers." in n
        and int(n.split(".")[2]) < split}
    assert first.num_stage_layers + last.num_stage_layers == 5


def test_layer_partition_favours_the_stage_with_the_lm_head(monkeypatch):
    config = tiny_config(49152, num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert stage_layer_counts(config, 1) == [30]
    assert stage_layer_counts(config, 2) == [19, 11]  # SmolLM2-135M's shape
    assert stage_layer_counts(config, 3) == [13, 12, 5]
    assert sum(stage_layer_counts(config, 7)) == 30 and min(stage_layer_counts(config, 7)) >= 1
    assert stage_layer_counts(config, 2, head_cost=2.0) == [23, 7]  # 4-bit layers, int8 head
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "15,15")
    assert stage_layer_counts(config, 2) == [15, 15]
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "20,20")
    with pytest.raises(ValueError, match="summing to 30"):
        stage_layer_counts(config, 2)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="2 layers cannot make 3 pipeline stages"):
        validate_pipeline_parallel(tiny_config(VOCAB), 3)
