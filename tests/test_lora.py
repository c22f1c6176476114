"""LoRA adapters (PEFT directories) on the base model: greedy tokens and logprobs equal to HF
transformers + PEFT in float32 for two adapters and the base in one batch; adapters and the
base never share a KV block; loads, unloads and bad adapters."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.errors import InvalidRequestError, LoRANotFoundError
from tests.helpers import TINY_FAMILY_SHAPE, hf_reference, read_metrics, save_hf_checkpoint

pytestmark = pytest.mark.slow

ATOL = 1e-4
NEW_TOKENS = 6
# two adapters on different projections: one on attention, one on the MLP and Q
TARGETS = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "mlp": ["gate_proj", "up_proj", "down_proj", "q_proj"]}


def _fresh_hf(base):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, attn_implementation="eager").eval()


def _peft_adapter(base, targets: list[str], directory, seed: int, rank: int = 8) -> None:
    """A random (non-zero B) adapter made and saved by PEFT itself, on a fresh base."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False)
    peft.get_peft_model(_fresh_hf(base), config).save_pretrained(directory)


@pytest.fixture(scope="module")
def case(tmp_path_factory, tokenizer):
    import transformers

    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    save_hf_checkpoint(transformers.LlamaConfig(**TINY_FAMILY_SHAPE, num_hidden_layers=3), base,
                       tokenizer)
    adapters = {}
    for seed, (name, targets) in enumerate(TARGETS.items(), start=1):
        _peft_adapter(base, targets, root / name, seed)
        adapters[name] = root / name
    torch.manual_seed(3)
    prompts = [torch.randint(10, 40000, (length,)).tolist() for length in (5, 19, 33)]
    return {"base": base, "adapters": adapters, "prompts": prompts}


def _hf_with(case, name: str | None):
    import peft

    base = _fresh_hf(case["base"])
    if name is None:
        return base
    return peft.PeftModel.from_pretrained(base, str(case["adapters"][name])).eval()


def _requests(case) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, str(path))
            for index, (name, path) in enumerate(case["adapters"].items())}


def test_two_adapters_and_the_base_in_one_batch_equal_hf_peft(case):
    loras = _requests(case)
    runs = [(prompt, name) for prompt in case["prompts"] for name in (None, "attn", "mlp")]
    with LLM(model=str(case["base"]), dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=8, max_num_batched_tokens=32) as llm:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, prompt_logprobs=0,
                                ignore_eos=True)
        outputs = llm.generate([p for p, _ in runs], params, use_tqdm=False,
                               lora_request=[loras.get(n) if n else None for _, n in runs])
    for (prompt, name), output in zip(runs, outputs):
        reference = _hf_with(case, name)
        _, tokens = hf_reference(reference, [prompt], NEW_TOKENS)
        assert output.outputs[0].token_ids == tokens[0], name
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, dim=-1)
        got = [entry[token].logprob for entry, token in
               zip(output.prompt_logprobs[1:], prompt[1:])]
        assert got == pytest.approx(
            expected.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist(),
            abs=ATOL), name
        if name is not None:  # the adapter changes the model: not the base's numbers
            base = outputs[runs.index((prompt, None))]
            assert got != pytest.approx([e[t].logprob for e, t in
                                         zip(base.prompt_logprobs[1:], prompt[1:])], abs=1e-3)


def test_adapters_and_the_base_share_no_kv_block(case):
    """A prompt cached under the base is computed again under an adapter (and under a second
    load of the same adapter), and hits the cache under its own."""
    loras = _requests(case)
    prompt = case["prompts"][2]
    params = SamplingParams(max_tokens=2, temperature=0)
    with LLM(model=str(case["base"]), dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=8, engine_core="thread", block_size=16) as llm:
        def cached(lora):
            return llm.generate(prompt, params, use_tqdm=False,
                                lora_request=lora)[0].num_cached_tokens

        assert cached(None) == 0 and cached(None) == 32
        assert cached(loras["attn"]) == 0 and cached(loras["attn"]) == 32
        assert cached(loras["mlp"]) == 0
        engine = llm.llm_engine
        engine.loras.remove("attn")
        assert cached(loras["attn"]) == 0  # loaded again: a new load, its own blocks


def test_load_unload_and_bad_adapters(case, tmp_path, tiny_llm):
    loras = _requests(case)
    with LLM(model=str(case["base"]), dtype="float32", enable_lora=True, max_loras=1,
             max_lora_rank=4) as llm:
        registry = llm.llm_engine.loras
        with pytest.raises(InvalidRequestError, match="max-lora-rank"):
            registry.add(loras["attn"])  # rank 8 > 4
        with pytest.raises(LoRANotFoundError):
            registry.remove("attn")
        low = tmp_path / "low"
        _peft_adapter(case["base"], ["q_proj"], low, seed=5, rank=4)
        registry.add(LoRARequest("low", 9, str(low)))
        with pytest.raises(InvalidRequestError, match="max-loras"):
            registry.add(LoRARequest("other", 10, str(low)))
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        config = json.loads((low / "adapter_config.json").read_text())
        (wrong / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        (wrong / "adapter_model.safetensors").write_bytes(
            (low / "adapter_model.safetensors").read_bytes())
        registry.remove("low")
        with pytest.raises(InvalidRequestError, match="DoRA"):
            registry.add(LoRARequest("wrong", 11, str(wrong)))
        with pytest.raises(InvalidRequestError, match="adapter_config.json"):
            registry.add(LoRARequest("none", 12, str(tmp_path)))
        out = llm.generate(case["prompts"][0], SamplingParams(max_tokens=3, temperature=0),
                           use_tqdm=False, lora_request=LoRARequest("low", 9, str(low)))
        assert len(out[0].outputs[0].token_ids) == 3
    # an engine started without --enable-lora (the session's tiny one) refuses any adapter
    with pytest.raises(InvalidRequestError, match="enable-lora"):
        tiny_llm.generate("x", use_tqdm=False, lora_request=loras["attn"])


def test_lora_modules_take_vllms_forms():
    """vLLM's --lora-modules: space-separated name=path items and JSON objects, repeatable;
    comma-separated items too; a base_model_name that is not the served model refused."""
    from kvserve.cli import _build_parser
    from kvserve.entrypoints.openai.server import parse_lora_modules

    args = _build_parser().parse_args([
        "serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": '
        '"smol"}', "--lora-modules", "c=/z,d=/w"])
    loras = parse_lora_modules(args.lora_modules, ("smol",))
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in loras] == [
        ("a", 1, "/x"), ("b", 2, "/y"), ("c", 3, "/z"), ("d", 4, "/w")]
    for bad, message in [('{"name": "b", "path": "/y", "base_model_name": "other"}',
                          "not the served model"), ('{"name": "b", "rank": 3}', "rank"),
                         ("nopath", "expected name=path")]:
        with pytest.raises(InvalidRequestError, match=message):
            parse_lora_modules((bad,), ("smol",))


# ---- over HTTP: --lora-modules, /v1/models, load and unload under load ------------------------
@pytest.fixture(scope="module")
def lora_server(case, tmp_path_factory):
    from kvserve.testing.server import ServerProcess

    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with ServerProcess(["--model", str(case["base"]), "--dtype", "float32",
                        "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "8", "--lora-modules",
                        f"attn={case['adapters']['attn']}"], log_path=log) as server:
        yield server
    assert server.exit_code == 0, log.read_text()[-3000:]


def test_adapters_over_http_load_and_unload_under_load(case, lora_server, tokenizer):
    """Base and adapter requests in flight while another adapter loads: none fails, each
    model's greedy tokens are HF + PEFT's; then unloads, and the 404s and 400s."""
    import concurrent.futures

    import httpx
    import openai

    base_url = lora_server.base_url
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "attn"} and models["attn"].model_extra["parent"] == "base"
    prompt = case["prompts"][1]
    expected = {model: [tokenizer.decode([t], False) for t in
                        hf_reference(_hf_with(case, name), [prompt], NEW_TOKENS)[1][0]]
                for model, name in (("base", None), ("attn", "attn"), ("mlp", "mlp"))}

    def run(model: str) -> list[str]:
        reply = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        return reply.json()["choices"][0]["logprobs"]["tokens"]

    models_run = ["base", "attn"] * 6
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(run, model) for model in models_run]
        loaded = httpx.post(f"{base_url}/v1/load_lora_adapter", timeout=120, json={
            "lora_name": "mlp", "lora_path": str(case["adapters"]["mlp"])})
        assert loaded.status_code == 200, loaded.text
        running += [pool.submit(run, "mlp") for _ in range(4)]
        models_run += ["mlp"] * 4
        for model, future in zip(models_run, running):
            assert future.result() == expected[model], model
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # three models

    assert httpx.post(f"{base_url}/v1/unload_lora_adapter",
                      json={"lora_name": "attn"}).status_code == 200
    missing = httpx.post(f"{base_url}/v1/completions", json={"model": "attn", "prompt": "x"})
    assert missing.status_code == 404 and "'attn'" in missing.json()["error"]["message"]
    again = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert again.status_code == 404
    bad = httpx.post(f"{base_url}/v1/load_lora_adapter", json={
        "lora_name": "bad", "lora_path": str(case["adapters"]["attn"]) + "-missing"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {"base", "mlp"}


def test_adapters_on_smollm2_equal_hf_peft(hf_model, smollm_source, tmp_path, tokenizer):
    """The real model (its GGUF, float32) with two PEFT adapters made on HF's own load of it,
    in one batch with the base."""
    import copy

    import peft

    adapters = {}
    for seed, (name, targets) in enumerate(TARGETS.items(), start=1):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=8, lora_alpha=8, target_modules=targets,
                                 init_lora_weights=False)
        model = peft.get_peft_model(copy.deepcopy(hf_model), config)
        with torch.no_grad():  # PEFT's random B is small next to a trained model's weights
            for module in model.modules():
                if hasattr(module, "lora_B") and "default" in module.lora_B:
                    module.lora_B["default"].weight.mul_(20)
        model.save_pretrained(tmp_path / name)
        adapters[name] = (model.eval(), LoRARequest(name, seed, str(tmp_path / name)))
    prompt = tokenizer.encode("The three primary colors are")
    runs = [None, "attn", "mlp"]
    with LLM(dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        outputs = llm.generate([prompt] * 3, SamplingParams(max_tokens=8, temperature=0,
                                                            ignore_eos=True),
                               use_tqdm=False,
                               lora_request=[adapters[n][1] if n else None for n in runs])
    got = [o.outputs[0].token_ids for o in outputs]
    expected = [hf_reference(adapters[n][0] if n else hf_model, [prompt], 8)[1][0]
                for n in runs]
    assert got == expected
    assert len({tuple(t) for t in got}) == 3  # the adapters change the answer


@pytest.mark.multiprocess
def test_adapters_with_two_tensor_parallel_ranks_equal_hf_peft(case):
    """TP=2 on the mp executor: each rank holds its columns of A (O, down) or rows of B (QKV
    by heads, gate/up), and the row-parallel deltas all-reduce with the base's partial sums."""
    loras = _requests(case)
    prompt = case["prompts"][2]
    with LLM(model=str(case["base"]), dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=8, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outputs = llm.generate([prompt] * 3, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                            ignore_eos=True), use_tqdm=False,
                               lora_request=[None, loras["attn"], loras["mlp"]])
    for output, name in zip(outputs, (None, "attn", "mlp")):
        assert output.outputs[0].token_ids == \
            hf_reference(_hf_with(case, name), [prompt], NEW_TOKENS)[1][0], name


def test_an_adapter_unloaded_mid_stream_finishes_its_requests(case, lora_server, tokenizer):
    """Streams on an adapter have begun when it is unloaded: each ends with HF + PEFT's
    tokens (the workers free its slot only after its last request), and new requests for
    it are 404s at once."""
    import itertools
    import json

    import httpx

    base_url = lora_server.base_url
    path = str(case["adapters"]["attn"])
    loaded = httpx.post(f"{base_url}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "late", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    prompt, length = case["prompts"][0], 600  # long enough to be running at the unload
    expected = [tokenizer.decode([t], False) for t in
                hf_reference(_hf_with(case, "attn"), [prompt], length)[1][0]]
    body = {"model": "late", "prompt": prompt, "max_tokens": length, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [stream.__enter__() for stream in streams]
        lines = [response.iter_lines() for response in responses]
        firsts = [next(line) for line in lines]  # each stream admitted and running
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 200
        assert read_metrics(base_url)["kvserve:num_requests_running"] > 0
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 404
        for stream, first, line in zip(streams, firsts, lines):
            tokens = []
            for raw in itertools.chain([first], line):
                if raw.startswith("data: {"):
                    logprobs = json.loads(raw[6:])["choices"][0]["logprobs"]
                    tokens += logprobs["tokens"] if logprobs else []
            stream.__exit__(None, None, None)
            assert tokens == expected
