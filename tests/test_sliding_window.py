"""Sliding-window attention end to end: per-layer windows read as HF transformers reads them (HF
configs, GGUF metadata), a backend that cannot apply them refused at load, and greedy tokens
equal to HF transformers' `generate` on tiny random Mistral and Qwen2 models whose prompts run
far past the window: every backend, batched and alone, chunked and whole, through the engine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve.attention import backends
from kvserve.config import ModelConfig
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError
from kvserve.model_source import resolve_model
from kvserve.models import load_model, random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.testing.tiny import tiny_config, write_tiny_model_dir, write_tokenizer_files
from kvserve.weights.gguf_file import config_from_metadata
from tests.helpers import assert_engine_chunked_and_cached_match, bounded

transformers = pytest.importorskip("transformers")

WINDOW = 64
NEW_TOKENS = 24
VOCAB = 512
MAX_LEN = 400
# Large random weights give sharp logits (top-2 margins ~0.1 here), so float32 rounding
# differences between HF and us cannot flip a greedy choice.
INIT_RANGE = 1.0
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=None,
            tie_word_embeddings=False)


# ---- configs: which layers get a window, as HF transformers decides


def _hf_windows(hf_config) -> tuple:
    """HF's own per-layer answer (transformers 5.x): Mistral windows every layer; Qwen2 the
    layers its `layer_types` mark sliding."""
    layers = hf_config.num_hidden_layers
    if hf_config.model_type == "mistral":
        return (hf_config.sliding_window,) * layers if hf_config.sliding_window else ()
    windows = tuple(hf_config.sliding_window if kind == "sliding_attention" else None
                    for kind in hf_config.layer_types)
    return windows if any(windows) else ()


@pytest.mark.parametrize("hf_config", [
    transformers.MistralConfig(num_hidden_layers=3, sliding_window=64),
    transformers.MistralConfig(num_hidden_layers=3, sliding_window=None),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                             max_window_layers=1),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=False, sliding_window=32,
                             max_window_layers=1),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                             layer_types=["sliding_attention", "full_attention"] * 2),
], ids=["mistral", "mistral-full", "qwen2-upper", "qwen2-off", "qwen2-layer-types"])
def test_hf_config_windows_match_transformers(hf_config):
    raw = hf_config.to_dict()
    config = ModelConfig.from_hf_dict(raw)
    assert config.sliding_windows == _hf_windows(hf_config)
    # a config.json saved before `layer_types` existed: Qwen2 derives it from max_window_layers
    raw.pop("layer_types", None)
    if "max_window_layers" in raw and hf_config.max_window_layers == 1:
        assert ModelConfig.from_hf_dict(raw).sliding_windows == _hf_windows(hf_config)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_hf_config_defaults_and_families():
    base = tiny_config().to_hf_dict()
    # MistralConfig's default window when config.json has no key; null: full attention
    mistral = dict(base, model_type="mistral", num_hidden_layers=2)
    assert ModelConfig.from_hf_dict(mistral).sliding_windows == (4096, 4096)
    assert ModelConfig.from_hf_dict(dict(mistral, sliding_window=None)).sliding_windows == ()
    # HF's Llama has no windows whatever its config says
    assert ModelConfig.from_hf_dict(dict(base, sliding_window=8)).sliding_windows == ()
    # other families (Gemma 3 later) follow layer_types; a config per layer of its own kind
    gemma_like = dict(base, model_type="gemma3_text", sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
    assert ModelConfig.from_hf_dict(gemma_like).sliding_windows == (8, None)
    assert ModelConfig.from_hf_dict(gemma_like).sliding_window(1) is None
    with pytest.raises(CorruptModelFileError, match="sliding_window"):
        ModelConfig.from_hf_dict(dict(gemma_like, sliding_window=None))
    with pytest.raises(UnsupportedArchitectureError, match="chunked_attention"):
        ModelConfig.from_hf_dict(dict(gemma_like, layer_types=["chunked_attention"] * 2))
    with pytest.raises(ValueError, match="positive"):
        tiny_config(sliding_windows=(0, None))
    # the JSON cache of GGUF configs hands back lists
    assert tiny_config(sliding_windows=[8, None]).sliding_windows == (8, None)


def _gguf_meta(**extra):
    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.vocab_size": 512,
            "llama.feed_forward_length": 128, "llama.block_count": 6,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 1024}
    meta.update({f"llama.attention.{key}": value for key, value in extra.items()})
    return config_from_metadata(meta, {"output.weight"}).sliding_windows


def test_gguf_sliding_window_metadata():
    assert _gguf_meta() == ()
    assert _gguf_meta(sliding_window=0) == ()
    assert _gguf_meta(sliding_window=512) == (512,) * 6
    # llama.cpp's pattern: an integer n windows every layer but each n-th (0: all)
    assert _gguf_meta(sliding_window=512, sliding_window_pattern=3) == (512, 512, None) * 2
    assert _gguf_meta(sliding_window=512, sliding_window_pattern=0) == (512,) * 6
    pattern = [True, False, True, True, False, False]
    assert _gguf_meta(sliding_window=8, sliding_window_pattern=pattern) == (
        8, None, 8, 8, None, None)
    with pytest.raises(CorruptModelFileError, match="entries"):
        _gguf_meta(sliding_window=8, sliding_window_pattern=[True])


# ---- a backend that cannot apply windows: refused at load, never wrong tokens


class _FullAttentionOnly:
    name = "full_only"

    def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=0):
        return backends.TorchReferenceBackend().forward(query, key, value, kv_cache, metadata,
                                                        scale)


def test_backend_without_windows_is_refused_at_load(monkeypatch, tmp_path, tokenizer):
    monkeypatch.setitem(backends._BACKENDS, "full_only",
                        lambda use_cpu_kernels: _FullAttentionOnly())
    assert random_model(tiny_config(), attention_backend="full_only") is not None
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window.*'full_only'"):
        random_model(tiny_config(sliding_windows=(None, 8)), attention_backend="full_only")
    directory = write_tiny_model_dir(tmp_path / "mistral", tokenizer, architecture="mistral",
                                     sliding_windows=(8, 8))
    assert json.loads((directory / "config.json").read_text())["sliding_window"] == 8
    with pytest.raises(UnsupportedArchitectureError, match="2 of its 2 layers"):
        load_model(resolve_model(directory), "float32", attention_backend="full_only")
    model, config = load_model(resolve_model(directory), "float32", attention_backend="paged")
    assert config.sliding_windows == (8, 8)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, 8]


# ---- HF parity on tiny random models


def _hf_model_dir(tmp_path_factory, tokenizer, name, hf_config):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    directory = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(directory)
    write_tokenizer_files(directory, tokenizer)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist()
               for n in (300, 277, 310)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return {"dir": directory, "prompts": prompts, "expected": expected}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer):
    """A 2-layer Mistral, every layer windowed to 64 keys."""
    config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **TINY)
    return _hf_model_dir(tmp_path_factory, tokenizer, "mistral", config)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer):
    """A 3-layer Qwen2 whose layers 1 and 2 are windowed (max_window_layers=1), layer 0 full."""
    config = transformers.Qwen2Config(num_hidden_layers=3, use_sliding_window=True,
                                      sliding_window=WINDOW, max_window_layers=1, **TINY)
    assert config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    return _hf_model_dir(tmp_path_factory, tokenizer, "qwen2", config)


def _greedy_chunked(model, prompts, chunk):
    """Prompts fed `chunk` tokens per step in one ragged batch; a sequence whose prompt is done
    decodes beside the others' chunks."""
    loop = PagedLoop(model, len(prompts), MAX_LEN)
    fed, outputs = [0] * len(prompts), [[] for _ in prompts]
    while any(len(out) < NEW_TOKENS for out in outputs):
        chunks, lengths, ids = [], [], []
        for i, prompt in enumerate(prompts):
            if fed[i] < len(prompt):
                piece = prompt[fed[i]: fed[i] + chunk]
            elif len(outputs[i]) < NEW_TOKENS:
                piece = [outputs[i][-1]]
            else:
                continue
            fed[i] += len(piece)
            chunks.append(piece)
            lengths.append(fed[i])
            ids.append(i)
        for i, logits in zip(ids, loop.step(chunks, lengths, ids)):
            if fed[i] >= len(prompts[i]):
                outputs[i].append(int(logits.argmax()))
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["torch_ref", "paged", "sdpa_batched"])
def test_greedy_tokens_match_hf_generate(family, backend, request):
    """All prompts in one ragged batch."""
    case = request.getfixturevalue(family)
    model, _ = load_model(resolve_model(case["dir"]), "float32", attention_backend=backend)
    prompts = case["prompts"]
    assert PagedLoop(model, len(prompts), MAX_LEN).greedy(prompts, NEW_TOKENS) == case["expected"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_alone_and_chunked_equal_hf_generate(family, backend, request):
    """Each prompt alone, and chunks of 50 (the paged kernel over cached context) and 150 (past
    its query limit: gathered SDPA), mixed with the others' decodes."""
    case = request.getfixturevalue(family)
    model, _ = load_model(resolve_model(case["dir"]), "float32", attention_backend=backend)
    prompts, expected = case["prompts"], case["expected"]
    for prompt, tokens in zip(prompts, expected):
        assert PagedLoop(model, 1, MAX_LEN).greedy([prompt], NEW_TOKENS) == [tokens]
    for chunk in (50, 150):
        assert _greedy_chunked(model, prompts, chunk) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_the_window_changes_the_tokens(family, request, tmp_path):
    """The parity above means something: the same weights with full attention disagree."""
    case = request.getfixturevalue(family)
    directory = tmp_path / family
    shutil.copytree(case["dir"], directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(sliding_window=None, use_sliding_window=False, layer_types=None)
    (directory / "config.json").write_text(json.dumps(raw))
    model, config = load_model(resolve_model(directory), "float32")
    assert config.sliding_windows == ()
    outputs = PagedLoop(model, 3, MAX_LEN).greedy(case["prompts"], NEW_TOKENS)
    assert all(out != tokens for out, tokens in zip(outputs, case["expected"]))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_engine_chunked_prefill_and_prefix_hits_match_hf(family, request):
    """Through the engine: prompts chunked by a 32-token budget, then served again from the
    prefix cache (chunks over cached blocks), give HF's tokens both times."""
    case = request.getfixturevalue(family)
    assert_engine_chunked_and_cached_match(case["dir"], case["prompts"], case["expected"],
                                           NEW_TOKENS)


@pytest.mark.slow
def test_engine_window_kv_is_bounded_and_prefix_hits_equal_no_hits(mistral):
    """The Mistral's one window group: while a 300-token prompt decodes, it holds the blocks
    of its last 64 positions only (ceil(63/16) + 1 = 5), never the 19 of a full table; the
    released blocks stay cached, so a second identical prompt hits; and greedy tokens with
    prefix caching on equal those with it off (and HF's)."""
    from kvserve import LLM, SamplingParams
    from kvserve.core.kv_cache.spec import SlidingWindowSpec

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt, expected = mistral["prompts"][0], mistral["expected"][0]
    outputs = {}
    for caching in (True, False):
        llm = LLM(model=str(mistral["dir"]), dtype="float32", block_size=16,
                  enable_prefix_caching=caching, engine_core="thread")
        engine = llm.llm_engine
        kv = engine.engine_core.kv_manager
        assert [type(group.spec) for group in kv.groups] == [SlidingWindowSpec]
        outputs[caching] = []
        for turn in range(2):
            engine.add_request(f"r{turn}", {"prompt_token_ids": prompt}, params)
            held, tokens = [], []
            for _ in bounded(200, "one request"):
                if not engine.has_unfinished_requests():
                    break
                for output in engine.step():
                    tokens = output.outputs[0].token_ids
                if 0 < len(tokens) < NEW_TOKENS:
                    held.append(kv.num_held_blocks(f"r{turn}"))
            assert held and max(held) <= 5, held
            outputs[caching].append(list(tokens))
        if caching:
            assert kv.stats.hits == (len(prompt) - 1) // 16 * 16
        assert kv.pool.num_used_blocks == 0
    assert outputs[True] == outputs[False] == [expected, expected]


def test_kv_transfer_is_refused_for_window_groups(mistral):
    """Slid-out blocks are freed, so a transfer would carry them empty: refused at start-up."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_config import EngineConfig

    with pytest.raises(ValueError, match="sliding-window KV cache groups"):
        LLMEngine(EngineConfig(model=str(mistral["dir"]), dtype="float32", kv_role="prefill",
                               engine_core="thread"))
