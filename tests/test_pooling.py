"""Pooling (--runner pooling): a tiny random Qwen3-Embedding-shaped checkpoint (HF's Qwen3Model
saved with save_pretrained: no LM head, names without `model.`; sentence-transformers' module
files beside it) embeds as sentence-transformers does (cosine >= 0.9999 in float32) with LAST,
MEAN and CLS pooling, chunked prompts, batches, token-id inputs, Matryoshka dimensions and the
prefix cache (used by LAST, skipped by MEAN); /v1/embeddings through OpenAI's
client, /pooling, /score and /rerank over HTTP order a small set as the reference does; the
400s (a pooling route on a generate runner and the reverse, dimensions too large, empty
input); run-batch forwards /v1/embeddings lines to a pooling runner."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from kvserve.config.pooler import PoolerConfig, resolve_pooler_config
from kvserve.errors import InvalidRequestError
from kvserve.pooling_params import PoolingParams
from kvserve.testing.server import ServerProcess
from kvserve.testing.tiny import write_tokenizer_files
from tests.helpers import long_text, tiny_server_flags

st = pytest.importorskip("sentence_transformers")

HIDDEN = 64
TEXTS = ["Hello world", "The capital of France is Paris.", "a",
         long_text()[:300], long_text()[300:700], "Embeddings map text to vectors."]
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
             "France's capital city is Paris.", "The stock market fell today.",
             "Berlin is the capital of Germany."]
LEGACY_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                "weightedmean_tokens", "lasttoken")


# ---- checkpoints and the reference ----------------------------------------------------------
def _write_base_checkpoint(directory: Path, tokenizer) -> None:
    """HF's Qwen3Model (random, norms random too) as save_pretrained writes it, with the
    tokenizer (a pad token, which sentence-transformers' batches need)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, tokenizer)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = tokenizer_config["eos_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _write_st_modules(directory: Path, mode: str, normalize: bool, legacy: bool) -> None:
    """sentence-transformers' modules.json, its Pooling config (the `pooling_mode_*` switches
    Qwen3-Embedding ships, or the current `pooling_mode`) and a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    legacy_key = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[mode]
    pooling = ({"word_embedding_dimension": HIDDEN, "include_prompt": True,
                **{f"pooling_mode_{key}": key == legacy_key for key in LEGACY_MODES}}
               if legacy else {"embedding_dimension": HIDDEN, "pooling_mode": mode,
                               "include_prompt": True})
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """The same weights three times: LAST + Normalize (Qwen3-Embedding's files), MEAN without
    Normalize (the current sentence-transformers format), CLS + Normalize."""
    root = tmp_path_factory.mktemp("qwen3-embedding")
    base = root / "last"
    base.mkdir()
    _write_base_checkpoint(base, tokenizer)
    _write_st_modules(base, "lasttoken", normalize=True, legacy=True)
    dirs = {"LAST": base}
    for kind, mode, normalize in (("MEAN", "mean", False), ("CLS", "cls", True)):
        directory = root / kind.lower()
        directory.mkdir()
        for item in base.iterdir():
            if item.is_file() and item.name != "modules.json":
                shutil.copy(item, directory / item.name)
        _write_st_modules(directory, mode, normalize, legacy=False)
        dirs[kind] = directory
    return dirs


@pytest.fixture(scope="module")
def reference(checkpoints):
    """sentence-transformers' embeddings (float32) of any texts, per checkpoint."""
    models = {kind: st.SentenceTransformer(str(path), device="cpu")
              for kind, path in checkpoints.items()}

    def embed(kind: str, texts: list[str]) -> torch.Tensor:
        return models[kind].encode(texts, convert_to_tensor=True).float()

    return embed


def _assert_close(vectors, expected: torch.Tensor) -> None:
    for vector, want in zip(vectors, expected):
        vector = torch.as_tensor(vector, dtype=torch.float32)
        assert vector.shape == want.shape
        assert torch.nn.functional.cosine_similarity(vector, want, dim=0) >= 0.9999
        assert torch.allclose(vector.norm(), want.norm(), rtol=1e-3)


def _order(scores) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -float(scores[i]))


# ---- the pooler config ----------------------------------------------------------------------
def test_pooler_config_from_the_checkpoint_and_overrides(checkpoints, tmp_path):
    assert resolve_pooler_config(checkpoints["LAST"]) == PoolerConfig("LAST", True)
    assert resolve_pooler_config(checkpoints["MEAN"]) == PoolerConfig("MEAN", False)
    assert resolve_pooler_config(checkpoints["CLS"]) == PoolerConfig("CLS", True)
    assert resolve_pooler_config(tmp_path) == PoolerConfig("LAST", True)  # no modules.json
    assert resolve_pooler_config(checkpoints["LAST"], '{"pooling_type": "mean", '
                                 '"normalize": false}') == PoolerConfig("MEAN", False)
    for bad in ('{"pooling_type": "MAX"}', '{"softmax": true}', '{"normalize": 1}'):
        with pytest.raises(ValueError):
            resolve_pooler_config(checkpoints["LAST"], bad)
    max_dir = tmp_path / "max"
    max_dir.mkdir()
    (max_dir / "modules.json").write_text(json.dumps([{"path": "1_Pooling",
                                                       "type": "x.models.Pooling"}]))
    (max_dir / "1_Pooling").mkdir()
    (max_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode": "max"}')
    with pytest.raises(ValueError, match="max"):
        resolve_pooler_config(max_dir)
    assert resolve_pooler_config(max_dir, {"pooling_type": "CLS"}).pooling_type == "CLS"


def test_pooling_params_verify():
    params = PoolingParams(dimensions=16)
    params.verify("MEAN", True, HIDDEN, [16, 32])
    assert params.normalize is True and params.skip_reading_prefix_cache
    with pytest.raises(InvalidRequestError, match="hidden size"):
        PoolingParams(dimensions=HIDDEN + 1).verify("LAST", True, HIDDEN)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        PoolingParams(dimensions=20).verify("LAST", True, HIDDEN, [16, 32])
    with pytest.raises(InvalidRequestError):
        PoolingParams(dimensions=0)


# ---- offline ---------------------------------------------------------------------------------
def _llm(directory: Path, **options):
    from kvserve import LLM

    settings = dict(runner="pooling", dtype="float32", num_kv_blocks=128, block_size=16,
                    max_num_batched_tokens=16, engine_core="thread")
    return LLM(model=str(directory), **{**settings, **options})


@pytest.fixture(scope="module")
def last_llm(checkpoints):
    llm = _llm(checkpoints["LAST"])
    yield llm
    llm.shutdown()


def test_last_pooling_chunked_and_batched_equals_sentence_transformers(last_llm, reference,
                                                                        tokenizer):
    assert max(len(tokenizer.encode(t)) for t in TEXTS) > 3 * 16  # several chunks each
    outputs = last_llm.embed(TEXTS, use_tqdm=False)
    expected = reference("LAST", TEXTS)
    _assert_close([o.outputs.embedding for o in outputs], expected)
    assert [o.outputs.hidden_size for o in outputs] == [HIDDEN] * len(TEXTS)
    by_ids = last_llm.encode([tokenizer.encode(t) for t in TEXTS], use_tqdm=False)
    _assert_close([o.outputs.data for o in by_ids], expected)
    assert [o.prompt_token_ids for o in by_ids] == [o.prompt_token_ids for o in outputs]


def test_last_pooling_reads_the_prefix_cache(last_llm, reference):
    text = long_text()[:600]
    first, again = (last_llm.embed([text], use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens >= 32  # LAST computes only the last position anew
    _assert_close([again.outputs.embedding, first.outputs.embedding],
                  reference("LAST", [text] * 2))


def test_matryoshka_dimensions_truncate_then_normalize(last_llm, reference):
    outputs = last_llm.embed(TEXTS[:3], PoolingParams(dimensions=24), use_tqdm=False)
    expected = torch.nn.functional.normalize(reference("LAST", TEXTS[:3])[:, :24], dim=1)
    _assert_close([o.outputs.embedding for o in outputs], expected)
    with pytest.raises(InvalidRequestError, match="hidden size"):
        last_llm.embed(TEXTS[:1], PoolingParams(dimensions=HIDDEN + 1), use_tqdm=False)


def test_offline_score_orders_as_the_reference(last_llm, reference):
    scores = [o.outputs.score for o in last_llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    vectors = reference("LAST", [QUERY, *DOCUMENTS])
    expected = [torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item()
                for v in vectors[1:]]
    assert np.allclose(scores, expected, atol=1e-4)
    assert _order(scores) == _order(expected)
    pairwise = last_llm.score(DOCUMENTS[:2], DOCUMENTS[2:4], use_tqdm=False)
    assert len(pairwise) == 2
    with pytest.raises(InvalidRequestError):
        last_llm.score(DOCUMENTS[:2], DOCUMENTS[:3], use_tqdm=False)


def test_a_pooling_runner_refuses_generation(last_llm):
    with pytest.raises(InvalidRequestError, match="pooling"):
        last_llm.generate(["Hello"], use_tqdm=False)


def test_mean_pooling_chunked_skips_the_prefix_cache(checkpoints, reference):
    """MEAN pools every position, so a repeat computes its whole prompt again (a prompt split
    over several steps and batched with others, as a cache hit would never be)."""
    texts = [long_text()[i * 350:(i + 1) * 350] for i in range(4)]
    expected = reference("MEAN", texts)
    llm = _llm(checkpoints["MEAN"], max_num_batched_tokens=48)
    try:
        outputs = llm.embed(texts, use_tqdm=False)
        _assert_close([o.outputs.embedding for o in outputs], expected)
        assert abs(torch.tensor(outputs[0].outputs.embedding).norm() - 1) > 0.01  # not normalized
        again = llm.embed(texts[:1], use_tqdm=False)[0]
        assert again.num_cached_tokens == 0
        _assert_close([again.outputs.embedding], expected[:1])
    finally:
        llm.shutdown()


def test_pooler_chunks_reruns_and_restarts():
    """The worker's pooler: chunks in any grouping give the whole prompt's pooling; a chunk run
    again (a batch re-run request by request) replaces its own sum; position 0 again (a
    preempted prompt computed anew) starts over."""
    from kvserve.sample.pooler import PromptPooler

    hidden = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    for kind, want in (("MEAN", hidden.mean(0)), ("LAST", hidden[-1]), ("CLS", hidden[0])):
        pooler = PromptPooler(PoolingParams(pooling_type=kind, normalize=True, dimensions=6))
        pooler.add_chunk(0, hidden[:3] * 5)  # a first attempt, preempted
        for start, stop in ((0, 4), (4, 7), (4, 7), (7, 10)):
            pooler.add_chunk(start, hidden[start:stop])
        expected = torch.nn.functional.normalize(want[:6], dim=0)
        assert torch.allclose(torch.tensor(pooler.result()), expected, atol=1e-6), kind


def test_cls_pooling_by_override_and_token_ids(checkpoints, reference, tokenizer):
    llm = _llm(checkpoints["LAST"], override_pooler_config={"pooling_type": "CLS"})
    try:
        outputs = llm.encode([tokenizer.encode(t) for t in TEXTS[:4]], use_tqdm=False)
        _assert_close([o.outputs.data for o in outputs], reference("CLS", TEXTS[:4]))
    finally:
        llm.shutdown()


# ---- over HTTP -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("pooling-server") / "server.log"
    flags = tiny_server_flags(checkpoints["LAST"], "--runner", "pooling",
                              "--served-model-name", "emb", "--max-num-batched-tokens", "16",
                              kv_blocks=256)
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert process.exit_code == 0, log.read_text()[-3000:]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_openai_client_embeddings(server, reference, tokenizer):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    expected = reference("LAST", TEXTS)
    response = client.embeddings.create(model="emb", input=TEXTS)  # the SDK asks for base64
    _assert_close([item.embedding for item in response.data], expected)
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    floats = client.embeddings.create(model="emb", input=TEXTS[1], encoding_format="float")
    _assert_close([floats.data[0].embedding], expected[1:2])
    short = client.embeddings.create(model="emb", input=TEXTS[:2], dimensions=32)
    _assert_close([item.embedding for item in short.data],
                  torch.nn.functional.normalize(expected[:2, :32], dim=1))


def test_embeddings_of_token_ids_base64_and_pooling(server, reference, tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS[:3]]
    expected = reference("LAST", TEXTS[:3])
    many = _post(server, "/v1/embeddings", {"input": ids, "encoding_format": "base64"})
    assert many.status_code == 200, many.text
    body = many.json()
    assert body["object"] == "list" and body["model"] == "emb"
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").copy()
               for item in body["data"]]
    _assert_close(decoded, expected)
    one = _post(server, "/v1/embeddings", {"input": ids[0], "model": "emb"}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids[0])
    _assert_close([one["data"][0]["embedding"]], expected[:1])
    pooled = _post(server, "/pooling", {"input": TEXTS[:3]}).json()
    assert [item["object"] for item in pooled["data"]] == ["pooling"] * 3
    _assert_close([item["data"] for item in pooled["data"]], expected)


def test_score_and_rerank_order_as_the_reference(server, reference):
    vectors = reference("LAST", [QUERY, *DOCUMENTS])
    expected = [torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item()
                for v in vectors[1:]]
    for body in ({"text_1": QUERY, "text_2": DOCUMENTS},
                 {"queries": QUERY, "documents": DOCUMENTS, "model": "emb"},
                 {"data_1": [QUERY] * len(DOCUMENTS), "data_2": DOCUMENTS}):
        response = _post(server, "/score", body)
        assert response.status_code == 200, response.text
        scores = [item["score"] for item in response.json()["data"]]
        assert np.allclose(scores, expected, atol=1e-4) and _order(scores) == _order(expected)
    for path in ("/rerank", "/v1/rerank"):
        response = _post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [r["index"] for r in results] == _order(expected)[:3]
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]]
                                                            for r in results]
        assert np.allclose([r["relevance_score"] for r in results],
                           sorted(expected, reverse=True)[:3], atol=1e-4)
    bare = _post(server, "/rerank", {"query": QUERY, "return_documents": False,
                                     "documents": [{"text": d} for d in DOCUMENTS]}).json()
    assert len(bare["results"]) == len(DOCUMENTS)
    assert all("document" not in r for r in bare["results"])


def test_pooling_runner_400s(server):
    cases = [("/v1/embeddings", {"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
             ("/v1/embeddings", {"input": ""}, "input"),
             ("/v1/embeddings", {"input": []}, "input"),
             ("/v1/embeddings", {"input": ["a", ""]}, "input"),
             ("/v1/embeddings", {"input": [[]]}, "input"),
             ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 4},
              "truncate_prompt_tokens"),
             ("/score", {"text_1": "a"}, None),
             ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
             ("/rerank", {"query": "q", "documents": []}, "documents"),
             ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "model"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
              "model")]
    for path, body, param in cases:
        response = _post(server, path, body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["message"], (path, body)
        if param is not None:
            assert error["param"] == param, (path, body, error)


def test_generate_runner_refuses_pooling_routes(smol_server):
    """The session's generate runner (conftest's smol_server: no server of its own to start)."""
    for path, body in (("/v1/embeddings", {"input": "hello"}), ("/pooling", {"input": "x"}),
                       ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        response = _post(smol_server, path, body)
        assert response.status_code == 400, (path, response.text)
        assert "--runner pooling" in response.json()["error"]["message"]
    assert _post(smol_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}
                 ).status_code == 200


def test_run_batch_embeddings_on_a_pooling_runner(checkpoints, reference, tmp_path):
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "emb", "input": text}})
             for i, text in enumerate(TEXTS[:3])]
    batch, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(batch), "-o", str(results),
         "--served-model-name", "emb", "--no-progress", "--runner", "pooling",
         *tiny_server_flags(checkpoints["LAST"], kv_blocks=64, max_model_len=512)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, results.read_text().splitlines())}
    vectors = []
    for i in range(3):
        response = records[f"e{i}"]["response"]
        assert response["status_code"] == 200, response
        vectors.append(response["body"]["data"][0]["embedding"])
    _assert_close(vectors, reference("LAST", TEXTS[:3]))
