"""Helpers that more than one test file uses. Fixtures stay in conftest.py; test files import
helpers from here only, never from one another or from conftest (tests/test_layers.py checks)."""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import os
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

# ---- prompts ----------------------------------------------------------------------------------
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the river,",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Les chats sont des animaux",
    "1, 2, 3, 5, 8, 13,",
]


def long_text() -> str:
    """Real prose and code (the standard library's textwrap module) for prompts > 1,000 tokens."""
    return inspect.getsource(textwrap)


def chat_prompts(tokenizer) -> list[str]:
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a terse assistant."},
         {"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "Explain what a hash table is."},
         {"role": "assistant", "content": "A map from keys to values using a hash function."},
         {"role": "user", "content": "And what is a collision?"}],
        [{"role": "user", "content": "List three prime numbers greater than 100."}],
    ]
    return [tokenizer.apply_chat_template(c) for c in conversations]


# ---- loops with an end ------------------------------------------------------------------------
def bounded(limit: int, what: str = "the loop") -> Iterator[int]:
    """`for _ in bounded(N):` in place of `while True:` around engine steps: a loop that never
    ends fails the test after N rounds instead of hanging it until the suite's timeout."""
    yield from range(limit)
    raise AssertionError(f"{what} did not end within {limit} rounds")


def step_until_raises(engine, error: type[BaseException], within: float,
                       match: str | None = None):
    """Step `engine` (after a fault) until it raises `error`, which must come within `within`
    seconds; returns pytest's ExceptionInfo."""
    import pytest

    started = time.monotonic()
    with pytest.raises(error, match=match) as failure:
        for _ in bounded(10_000, f"stepping until {error.__name__}"):
            engine.step()
    assert time.monotonic() - started < within
    return failure


def wait_until(condition: Callable[[], object], timeout: float = 10.0,
               what: str = "the condition", interval: float = 0.02) -> None:
    """Poll `condition()` until it holds; an AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: timed out after {timeout} s"
        time.sleep(interval)


# ---- kernel levels ----------------------------------------------------------------------------
def ops_of(level: str):
    """The op set of `level`: "torch" (the reference ops) or a compiled build this machine
    runs; a build that fails is a test failure, not a skip."""
    import pytest

    from kvserve.errors import KernelBuildError
    from kvserve.kernels import compiled_ops, reference

    if level == "torch":
        return reference
    try:
        return compiled_ops(level)
    except KernelBuildError as error:
        pytest.fail(str(error), pytrace=False)


@contextmanager
def kernel_level(level: str) -> Iterator[None]:
    """Build what runs inside at this kernel ISA level: KVSERVE_CPU_ISA caps it, and models,
    engines and core processes started meanwhile load that level's build (a model keeps the op
    set it was built with)."""
    from kvserve.kernels import get_ops, isa

    saved = os.environ.get(isa.ISA_ENV)
    os.environ[isa.ISA_ENV] = level
    try:
        assert get_ops(True).isa == level, f"{level} is not a level this machine runs"
        yield
    finally:
        if saved is None:
            os.environ.pop(isa.ISA_ENV, None)
        else:
            os.environ[isa.ISA_ENV] = saved


# ---- HF transformers reading GGUF files ------------------------------------------------------
_GGUF_READERS: dict[tuple, object] = {}  # read-only readers, kept for the whole session


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside, `gguf.GGUFReader` parses each file once and hands the same reader (a read-only
    memory map) to every later caller, in this block or any later one of the session (the
    HF reference model and tokenizer of one file; Gemma's in tests/test_gemma3.py and
    tests/test_sentencepiece_tokenizer.py). HF transformers opens a GGUF file again for each
    part it loads (config, then weights or tokenizer), and the gguf package parses every
    metadata value into numpy views: ~20 s a time for Gemma 3's 262k-token vocabulary on one
    core (see kvserve/weights/gguf_reader.py). What HF reads from the file is the same either
    way; a file written again (a new size or mtime) is parsed again."""
    import gguf

    parse = gguf.GGUFReader

    def parsed_once(path, mode="r"):
        if mode != "r":
            return parse(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = parse(path, mode)
        return _GGUF_READERS[key]

    gguf.GGUFReader = parsed_once
    try:
        yield
    finally:
        gguf.GGUFReader = parse


# ---- processes --------------------------------------------------------------------------------
def process_alive(pid: int) -> bool:
    """True while /proc lists the pid as anything but a zombie. A process reaped between the
    open and the read makes the read fail with ESRCH: gone too."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_server_tree(server) -> None:
    """kill -9 of a whole `ServerProcess`, its engine core first (as an OOM kill or a lost
    machine takes it)."""
    import psutil

    for child in psutil.Process(server.process.pid).children(recursive=True):
        child.kill()
    server.process.kill()
    server.process.wait(10)


# ---- servers ----------------------------------------------------------------------------------
def tiny_server_flags(model_dir, *extra: str, kv_blocks: int = 1024,
                      max_model_len: int = 2048) -> list[str]:
    """`kvserve serve` flags for the tiny random model in float32."""
    return ["--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", str(kv_blocks),
            "--max-model-len", str(max_model_len), "--disable-log-requests", *extra]


def complete_with_kv(base_url: str, prompt: str, max_tokens: int, kv=None) -> dict:
    """A greedy /v1/completions answer (asserted 200), with `kv_transfer_params` when given:
    the disaggregated flow as a proxy drives it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def read_metrics(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """Sample name -> value (summed over label sets), parsed with prometheus_client."""
    values: dict[str, float] = {}
    for sample in _metric_samples(base_url, headers):
        values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def finished_by_reason(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """kvserve:request_success_total per finished_reason label (stop, length, abort, error)."""
    reasons: dict[str, float] = {}
    for sample in _metric_samples(base_url, headers):
        if sample.name == "kvserve:request_success_total":
            reason = sample.labels["finished_reason"]
            reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


def _metric_samples(base_url: str, headers: dict | None):
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        yield from family.samples


def finished_count(metrics: dict[str, float]) -> float:
    return metrics.get("kvserve:request_success_total", 0.0)


def wait_idle(base_url: str, timeout: float = 3.0, headers: dict | None = None,
              finished_at_least: float = 0.0) -> dict:
    """Poll /metrics until nothing runs, nothing waits, no KV block is in use, and at least
    `finished_at_least` requests have finished (aborts included)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(base_url, headers)
        idle = (metrics["kvserve:num_requests_running"] == 0
                and metrics["kvserve:num_requests_waiting"] == 0
                and metrics["kvserve:kv_cache_usage_perc"] == 0
                and finished_count(metrics) >= finished_at_least)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def assert_idle(base_url: str, timeout: float = 30.0, headers: dict | None = None,
                quiet_seconds: float = 0.5) -> dict:
    """Wait for idle metrics, assert them, and check no zombie keeps generating tokens."""
    metrics = wait_idle(base_url, timeout=timeout, headers=headers)
    assert metrics["kvserve:num_requests_running"] == 0, metrics
    assert metrics["kvserve:num_requests_waiting"] == 0, metrics
    assert metrics["kvserve:kv_cache_usage_perc"] == 0, metrics
    time.sleep(quiet_seconds)
    later = read_metrics(base_url, headers)
    assert later["kvserve:generation_tokens_total"] == metrics["kvserve:generation_tokens_total"]
    return later


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def streamed_response(client, **request):
    """A streamed /v1/responses call through the openai client: each delta event's deltas put
    together by event type, and the completed response."""
    deltas: dict[str, str] = {}
    completed = None
    for event in client.responses.create(stream=True, **request):
        if event.type.endswith(".delta"):
            deltas[event.type] = deltas.get(event.type, "") + event.delta
        elif event.type == "response.completed":
            completed = event.response
    return deltas, completed


async def complete(client, prompt: str, stream: bool = False, max_tokens: int = 8):
    """A greedy /v1/completions call: (status, JSON body), or (status, the SSE data lines)
    when streaming."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=payload)
        return response.status_code, response.json()
    events = []
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return response.status_code, events


async def watch_health(base_url: str, stop: asyncio.Event, interval: float = 0.005) -> list:
    """/health's status codes, polled from now until `stop` is set or the server stops
    answering ("gone" ends the list). Started before a fault, it sees every state the server
    passes through on the way down, however short."""
    statuses: list = []
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            try:
                statuses.append((await client.get("/health")).status_code)
            except httpx.TransportError:
                statuses.append("gone")
                break
            await asyncio.sleep(interval)
    return statuses


def assert_health_went_503_then_gone(statuses: list) -> None:
    """What `watch_health` saw around an engine's death in a server that then exits: 200 while
    it served (if the watch began early enough), then 503 on every poll, until the server went
    away."""
    assert statuses and statuses[-1] == "gone", statuses
    assert 503 in statuses, f"/health never answered 503: {statuses}"
    first = statuses.index(503)
    assert set(statuses[:first]) <= {200} and set(statuses[first:-1]) == {503}, statuses


def wait_router_synced(router, timeout: float = 30.0) -> None:
    """Every replica of a `kvserve router` healthy and its block index in step."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(router.base_url + "/router/state", timeout=5).json()["replicas"]
        if all(s["healthy"] and s["synced"] for s in state.values()):
            return
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


# ---- the KV cache manager and its events ------------------------------------------------------
def make_request(request_id: str, tokens: list[int], max_tokens: int = 16,
                 cache_salt: str | None = None):
    from kvserve.core.request import Request
    from kvserve.sampling_params import SamplingParams

    return Request(request_id, tokens, SamplingParams(), max_tokens=max_tokens,
                   cache_salt=cache_salt)


def admit(kv, request) -> int:
    """Prefix lookup + allocation for the whole prompt + mark it computed (as a step would);
    returns the prefix hit in tokens."""
    blocks, hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit, blocks)
    kv.record_prefix_lookup(request.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return hit


EVENT_BLOCK = 4  # block size of the in-process KV event publishers below


def kv_event_publisher(pub_port: int, replay_port: int):
    """A real block pool publishing its KV events on loopback ports: (kv manager, source)."""
    from kvserve.core.kv_cache.manager import KVCacheManager
    from kvserve.kv_events import make_kv_event_source

    kv = KVCacheManager(num_blocks=32, block_size=EVENT_BLOCK)
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d", '
              '"replay_endpoint": "tcp://127.0.0.1:%d", "heartbeat_seconds": 0.2}'
              % (pub_port, replay_port))
    return kv, make_kv_event_source(config, kv)


def cache_tokens(kv, source, tokens: list[int], cache_salt: str | None = None) -> None:
    """Compute `tokens` as a finished request would (its full blocks stay cached, hashed under
    `cache_salt` if any), publish."""
    request = make_request(f"{len(tokens)}-{tokens[0]}-{cache_salt}", tokens, max_tokens=4,
                           cache_salt=cache_salt)
    admit(kv, request)
    kv.free(request)
    source.flush()


# ---- a mixed workload on a small pool: chunked prefill, prefix hits, preemption, n > 1, stops --
_SHARED = "You are a careful assistant. Answer briefly and precisely. " * 3
MIXED_PROMPTS = [_SHARED + q for q in ("What is a cat?", "Name a river.", "Count to five.",
                                       "Say hello.", "Why is the sky blue?",
                                       "Spell 'tree'.")] + [
    "The quick brown fox", "Once upon a time", "def main():", "Paris is", "1, 2, 3,",
    "import os\n", "Hello", "The capital of", "A long time ago in a galaxy far, far away " * 4,
    "x"]


def small_pool_options(**extra) -> dict:
    # a small pool and budget: prompts are chunked, and requests get preempted
    return dict(dtype="float32", num_kv_blocks=24, block_size=16, max_num_batched_tokens=64,
                **extra)


def _mixed_workload():
    from kvserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    params = [greedy] * len(MIXED_PROMPTS)
    params[3] = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    params[7] = SamplingParams(temperature=0, max_tokens=40, stop=["e"])
    return MIXED_PROMPTS, params


def run_mixed_workload(llm) -> tuple[list[list[list[int]]], list[float]]:
    """Every sample's tokens, and the logprobs of the sampled tokens where asked for."""
    prompts, params = _mixed_workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[o.token_ids for o in out.outputs] for out in outputs]
    logprobs = [step[token].logprob for out in outputs for o in out.outputs if o.logprobs
                for step, token in zip(o.logprobs, o.token_ids)]
    return tokens, logprobs


def single_process_reference(model_dir) -> tuple[list, list[float], int]:
    """The workload on one process with the core on a thread: (tokens, logprobs, preemptions)."""
    from kvserve import LLM

    llm = LLM(model=str(model_dir), engine_core="thread", **small_pool_options())
    tokens, logprobs = run_mixed_workload(llm)
    preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
    llm.shutdown()
    return tokens, logprobs, preemptions


# ---- GGUF files -------------------------------------------------------------------------------
def ragged_against_alone(max_len: int = 128, new_tokens: int = 8) -> dict:
    """SmolLM2 in float32 on the paged path: the largest logit difference between the chat and
    raw prompts run in one ragged batch and each alone, and both runs' greedy tokens (for
    tests/test_hf_parity.py, which runs this under strict BLAS reproducibility)."""
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model
    from kvserve.models.paged_loop import PagedLoop
    from kvserve.tokenizer import load_tokenizer

    source = resolve_model("smollm2-135m-instruct")
    model, _ = load_model(source, "float32", attention_backend="paged")
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(p) for p in chat_prompts(tokenizer) + RAW_PROMPTS]
    batched = PagedLoop(model, num_seqs=len(prompts), max_len=max_len).step(
        prompts, [len(p) for p in prompts], list(range(len(prompts))), all_logits=True)
    single = PagedLoop(model, num_seqs=1, max_len=max_len)
    worst = max((single.step([ids], [len(ids)], [0], all_logits=True)[0] - logits)
                .abs().max().item() for ids, logits in zip(prompts, batched))
    return {"max_logit_difference": worst,
            "greedy_batched": PagedLoop(model, len(prompts), max_len).greedy(prompts, new_tokens),
            "greedy_alone": [PagedLoop(model, 1, max_len).greedy([p], new_tokens)[0]
                             for p in prompts]}


def llama_cpp_permute(weights, num_heads: int):
    """What llama.cpp's converter does to HF Q/K rows (the inverse of our un-permute)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_TO_GGUF[rest]}"


def write_gguf(path, config, tensors: dict, arch="llama", qtype=None,
               raw_override: dict | None = None, metadata=None):
    """A GGUF file as llama.cpp's converter writes one, from HF-named numpy arrays. `qtype`:
    one storage type for every matrix, or a function of the GGUF tensor name (None: float);
    `metadata(writer)`: more keys (a tokenizer, say)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if metadata is not None:
        metadata(writer)
    for name, array in tensors.items():
        gguf_name = _gguf_name(name)
        permuted = arch in ("llama", "mistral")  # llama.cpp's converter permutes these only
        if permuted and "q_proj" in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif permuted and "k_proj" in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if raw_override and gguf_name in raw_override:
            data, raw_type = raw_override[gguf_name]
            writer.add_tensor(gguf_name, data, raw_dtype=raw_type)
        elif array.ndim == 2 and (kind := qtype(gguf_name) if callable(qtype) else qtype):
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_gguf(src, dst, replace: dict | None = None) -> None:
    """A GGUF file's metadata and tensors written again to `dst`, with `replace` mapping a
    tensor's name to a float array in its place, a (bytes [rows, row bytes], GGMLQuantization
    Type) pair (blocks of another type), or None to leave the tensor out (a damaged file for the
    bad-input tests)."""
    import gguf

    replace = replace or {}
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for tensor in reader.tensors:
        if tensor.name not in replace:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        elif isinstance(replace[tensor.name], tuple):
            data, kind = replace[tensor.name]
            writer.add_tensor(tensor.name, data, raw_dtype=kind)
        elif replace[tensor.name] is not None:
            writer.add_tensor(tensor.name, replace[tensor.name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_until_finished(engine, request_id, prompt, params, kv=None):
    """Add one request to an LLMEngine (with a KV transfer handle, if any) and step until it
    finishes; its final RequestOutput."""
    engine.add_prepared(engine.prepare_request(request_id, prompt, params,
                                               kv_transfer_params=kv))
    for _ in bounded(10_000, f"request {request_id}"):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def wait_engine_idle(engine, timeout=5.0) -> int:
    """Wait until an in-process engine core holds no KV blocks (held blocks released by
    housekeeping); the blocks still in use."""
    deadline = time.monotonic() + timeout
    core = engine.engine_core
    while core.kv_manager.pool.num_used_blocks and time.monotonic() < deadline:
        core.housekeeping()
        time.sleep(0.02)
    return core.kv_manager.pool.num_used_blocks


def assert_engine_chunked_and_cached_match(directory, prompts, expected, new_tokens,
                                           chunk_tokens: int = 32) -> None:
    """Through the engine (core on a thread, float32): the prompts chunked by a `chunk_tokens`
    budget, then served again from the prefix cache (chunks over cached blocks), give the
    expected greedy tokens both times, and the second pass hits the cache."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(directory), dtype="float32", max_num_batched_tokens=chunk_tokens,
              enable_prefix_caching=True, block_size=16, engine_core="thread")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    for _ in range(2):
        results = llm.generate(requests, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in results] == expected
    assert llm.llm_engine.engine_core.kv_manager.stats.hits > 0


# ---- llama.cpp's converter --------------------------------------------------------------------
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # the peers' llama.cpp (benchmarks/peers/)
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llama_cpp_converter_tree():
    """The `convert_hf_to_gguf.py` of llama.cpp's tree (with its `conversion` package and
    `gguf-py`), from the llama-cpp-python source distribution on PyPI: extracted once into
    kvserve's cache directory (the peers' download is reused when present)."""
    import tarfile

    from kvserve.paths import cache_dir

    tree = cache_dir() / f"llama-cpp-convert-{LLAMA_CPP_SDIST.split('==')[1]}"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    sdist = _llama_cpp_sdist()
    name = sdist.name
    partial = tree.with_suffix(".partial")
    with tarfile.open(sdist) as archive:
        prefix = f"{name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        members = []
        for member in archive.getmembers():
            rest = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and rest.startswith(_CONVERTER_PARTS):
                member.name = rest
                members.append(member)
        archive.extractall(partial, members=members, filter="data")
    partial.rename(tree)
    return tree


def _llama_cpp_sdist():
    """The llama-cpp-python source distribution (the peers' download, else pip's, cached)."""
    import subprocess
    import sys

    from kvserve.paths import cache_dir

    name = f"llama_cpp_python-{LLAMA_CPP_SDIST.split('==')[1]}.tar.gz"
    sdists = Path(__file__).parent.parent / "benchmarks" / "peers" / "work" / "sdist"
    if not (sdists / name).is_file():
        sdists = cache_dir() / "sdist"
        if not (sdists / name).is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary", ":all:", LLAMA_CPP_SDIST, "-d", str(sdists)],
                           check=True, timeout=600)
    return sdists / name


def llama_cpp_chat_template(name: str) -> str:
    """A model's own chat template as llama.cpp's tree keeps it (models/templates/<name>.jinja,
    e.g. "openai-gpt-oss-120b": the template of gpt-oss's Hugging Face repository), extracted
    once from the llama-cpp-python sdist into kvserve's cache directory."""
    import tarfile

    from kvserve.paths import cache_dir

    path = cache_dir() / f"llama-cpp-templates-{LLAMA_CPP_SDIST.split('==')[1]}" / f"{name}.jinja"
    if not path.is_file():
        sdist = _llama_cpp_sdist()
        member = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/models/templates/" \
                 f"{name}.jinja"
        with tarfile.open(sdist) as archive:
            text = archive.extractfile(member).read().decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        partial.rename(path)
    return path.read_text()


def convert_hf_to_gguf(model_dir, outfile, outtype: str = "f32"):
    """`outfile`: the HF directory as llama.cpp's own converter writes it (its `main()` as the
    script runs it, each time in a fresh fork of one process that imported it once)."""
    log = Path(f"{outfile}.convert.log")
    code = _converter().convert([str(model_dir), "--outfile", str(outfile),
                                 "--outtype", outtype], log)
    assert code == 0, log.read_text()[-3000:]
    return outfile


# The converter's child: imports the converter (torch, transformers' tokenizers, gguf-py) once,
# then forks a child per conversion, whose state dies with it. Why: a tiny Mixtral took 5.8 s
# as a fresh `python convert_hf_to_gguf.py` and 2.4 s forked (the same bytes), most of it the
# import every conversion of the suite paid. A job is a JSON line {argv, log}; the answer is
# the exit code.
_CONVERTER_SERVER = """
import importlib.util, json, os, sys, traceback
tree = sys.argv[1]
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf",
                                              os.path.join(tree, "convert_hf_to_gguf.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from transformers import AutoTokenizer  # noqa: F401  (what the converter's vocabulary reads)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 0
        try:
            sys.argv = ["convert_hf_to_gguf.py", *job["argv"]]
            module.main()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""
CONVERSION_TIMEOUT_S = 600


class _ConverterProcess:
    """The converter's child (_CONVERTER_SERVER), started on the first conversion and ended
    with the test session (its stdin closes)."""

    def __init__(self):
        import subprocess
        import sys

        tree = llama_cpp_converter_tree()
        env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
        self.process = subprocess.Popen([sys.executable, "-c", _CONVERTER_SERVER, str(tree)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, text=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def convert(self, argv: list[str], log: Path) -> int:
        import select

        self.process.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], CONVERSION_TIMEOUT_S)
        answer = self.process.stdout.readline() if ready else ""
        if not answer:
            self.process.kill()
            raise AssertionError(f"llama.cpp's converter gave no answer ({argv})")
        return int(answer)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


_converter_process: _ConverterProcess | None = None


def _converter() -> _ConverterProcess:
    global _converter_process
    if _converter_process is None or not _converter_process.alive():
        _converter_process = _ConverterProcess()
        atexit.register(_converter_process.close)
    return _converter_process


# ---- tiny checkpoints saved by HF transformers ------------------------------------------------
def randomise_norms(hf_model) -> None:
    """Every norm weight drawn at random (HF initialises Gemma's to zero and the others' to one,
    which would hide a norm applied without its weight, or with the wrong offset), and every
    bias (HF's are zero, which would hide one not added, or added by every tensor-parallel
    rank)."""
    import torch

    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if "gemma" in hf_model.config.model_type \
                    else param.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "_bias")):
                param.uniform_(-0.05, 0.05)


def write_sentencepiece_model(path) -> None:
    """A small SentencePiece model trained on real text (the weights tests feed token ids, so
    only llama.cpp's converter reads it, for families whose converter reads nothing else; it
    pads the vocabulary to the model's)."""
    import io

    import sentencepiece

    lines = [line for line in long_text().splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                             vocab_size=600, byte_fallback=True,
                                             minloglevel=2)
    path.write_bytes(model.getvalue())


def save_hf_checkpoint(hf_config, directory, tokenizer, sentencepiece: bool = False):
    """A tiny random checkpoint made by HF's own model class for `hf_config` (seed 0, norms
    random), saved with the tokenizer's files (and a SentencePiece model where llama.cpp's
    converter needs one); returns HF's model (eager attention, eval mode)."""
    import torch
    import transformers

    from kvserve.testing.tiny import write_tokenizer_files

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager").eval()
    randomise_norms(hf_model)
    hf_model.save_pretrained(directory)
    write_tokenizer_files(directory, tokenizer)
    if sentencepiece:
        write_sentencepiece_model(directory / "tokenizer.model")
    return hf_model


def hf_reference(hf_model, prompts: list[list[int]], new_tokens: int):
    """HF's last-position logits for each prompt (one forward each) and its greedy tokens."""
    import torch

    logits, tokens = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(hf_model(ids).logits[0, -1])
            out = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    return logits, tokens


def tiny_family_case(name: str, hf_config, directory, tokenizer, prompt_lengths,
                     new_tokens: int, sentencepiece: bool = False) -> dict:
    """A family test's case: the tiny checkpoint HF saves for `hf_config` (save_hf_checkpoint),
    random prompts of `prompt_lengths` tokens (seed 1), and HF's last-position logits and greedy
    tokens for each (hf_reference), computed once for every test that takes the case."""
    import torch

    hf_model = save_hf_checkpoint(hf_config, directory, tokenizer, sentencepiece=sentencepiece)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf_config.vocab_size, (n,), generator=generator).tolist()
               for n in prompt_lengths]
    logits, tokens = hf_reference(hf_model, prompts, new_tokens)
    return {"name": name, "dir": directory, "hf_config": hf_config, "hf_model": hf_model,
            "prompts": prompts, "logits": logits, "tokens": tokens}


def assert_last_logits_match_hf(model, case: dict, max_len: int, atol: float = 1e-4) -> None:
    """The model's last-position logits for a case's prompts (tiny_family_case), all in one
    ragged batch, are HF's within `atol` (float32)."""
    import torch

    from kvserve.models.paged_loop import PagedLoop

    prompts = case["prompts"]
    got = PagedLoop(model, len(prompts), max_len).step(prompts, [len(p) for p in prompts],
                                                      list(range(len(prompts))))
    for ours, theirs in zip(got, case["logits"]):
        torch.testing.assert_close(ours.float(), theirs, atol=atol, rtol=1e-4)


def decode_logits(model, prompts: list[list[int]], steps: int, eager: bool,
                  max_len: int = 96):
    """Greedy decode of every prompt together, through the decode stack or (`eager`) the
    Python loop: the logits of each step, stacked [steps + 1, prompts, vocab]."""
    import torch

    from kvserve.models.paged_loop import PagedLoop

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


def assert_greedy_batched_and_alone(model, prompts: list[list[int]], expected: list[list[int]],
                                    new_tokens: int, max_len: int) -> None:
    """The model's greedy tokens for the prompts, all in one batch and each alone, are
    `expected` (HF's)."""
    from kvserve.models.paged_loop import PagedLoop

    assert PagedLoop(model, len(prompts), max_len).greedy(prompts, new_tokens) == expected
    for prompt, tokens in zip(prompts, expected):
        assert PagedLoop(model, 1, max_len).greedy([prompt], new_tokens) == [tokens]


def edited_checkpoint(directory, destination, edit: Callable[[dict], None]):
    """`directory`'s checkpoint with its config.json changed by `edit` (the weights and
    tokenizer files linked, not copied)."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in directory.iterdir():
        if path.name != "config.json":
            (destination / path.name).symlink_to(path)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


# ---- tiny family checkpoints ------------------------------------------------------------------
# Tiny random HF checkpoints on the SmolLM2 tokenizer's vocabulary (llama.cpp's converter accepts
# its pre-tokenizer by hash); each family test adds its layers, head size and context.
TINY_FAMILY_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)


def rope_both(compiled, metadata, positions, kv_cache, qkv, heads: int, kv_heads: int,
              dim: int):
    """Rotate and cache with the compiled op in place (a random cos/sin table); returns the
    reference op's (qkv, cache) from copies of the same inputs."""
    import torch

    from kvserve.kernels import reference

    table = torch.randn(64, dim)
    qkv2, cache2 = qkv.clone(), kv_cache.clone()
    compiled.rope_and_cache_(qkv, positions, table, kv_cache, metadata.slot_mapping, heads,
                             kv_heads, dim)
    reference.rope_and_cache_(qkv2, positions, table, cache2, metadata.slot_mapping, heads,
                              kv_heads, dim)
    return qkv2, cache2


# ---- kernels ---------------------------------------------------------------------------------
def assert_equals_linear_of_rounded_x(kernel, packed, dense, dtype, rounding=None):
    """1..17 and 25 rows (passes of up to 8, or 12 with AVX512-VNNI, split evenly), with and
    without bias, rows contiguous or a strided view (the kernel reads them in place): the float
    linear of x' (x rounded as the kernel rounds it: `rounding`, by default per group of 32) up
    to float accumulation order, or bf16 output rounding."""
    import torch

    from kvserve.kernels import reference

    rounding = rounding or reference.quantize_activations_q8

    rows, cols = dense.shape
    generator = torch.Generator().manual_seed(rows + cols)
    bias = torch.randn(rows, generator=generator).to(dtype)
    tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    for m in [*range(1, 18), 25]:
        wide = torch.randn(m, cols + 32, generator=generator).to(dtype)
        x = wide[:, 16:16 + cols] if m % 2 else wide[:, :cols].contiguous()
        for b in (None, bias):
            rounded = rounding(x)
            expected = torch.nn.functional.linear(rounded, dense,
                                                  None if b is None else b.float())
            got = kernel(x, packed, b, rows)
            assert got.dtype == dtype and got.shape == (m, rows)
            torch.testing.assert_close(got.float(), expected, rtol=tolerance,
                                       atol=tolerance * expected.abs().max().item())


# ---- a tiny Q4_K_M-typed GGUF -------------------------------------------------------------
Q4_K_M_CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_hidden_layers=2)
# a Q4_K_M file's choices (llama.cpp keeps some V and down projections in Q6_K)
Q4_K_M_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0",
                "output": "Q6_K"}
# byte offsets of each K-quant block's float16 scales (d, and dmin for Q4_K)
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _q4_k_m_rows(qtype: str, rows: int, cols: int, generator):
    """A tensor's bytes in `qtype`: gguf's quantization of small random weights where the
    package has one, else random blocks with small scales (weights of a few hundredths)."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _SCALE_OFFSETS:
        weights = generator.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quants.quantize(weights, kind)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = generator.integers(0, 256, (rows, cols // block_values, block_bytes), np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scale = (generator.uniform(1, 2, (rows, cols // block_values)) * 3e-4
                 ).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(rows, -1)


def write_q4_k_m(path, tied: bool, seed: int = 0):
    """A tiny Llama GGUF with each matrix in Q4_K_M_TYPES' block type (the norms float32):
    tests/test_gguf_stored.py's model, and the packed-panel cache's."""
    import gguf
    import numpy as np

    from kvserve.testing.tiny import tiny_config

    config = tiny_config(**Q4_K_M_CONFIG, tie_word_embeddings=tied)
    generator = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    if not tied:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, config.hidden_size),
                       p + "self_attn.k_proj.weight": (kv, config.hidden_size),
                       p + "self_attn.v_proj.weight": (kv, config.hidden_size),
                       p + "self_attn.o_proj.weight": (config.hidden_size, q),
                       p + "mlp.gate_proj.weight": (inter, config.hidden_size),
                       p + "mlp.up_proj.weight": (inter, config.hidden_size),
                       p + "mlp.down_proj.weight": (config.hidden_size, inter)})
    tensors, raw = {}, {}
    for name, (rows, cols) in shapes.items():
        tensors[name] = np.zeros((rows, cols), np.float32)
        gguf_name = _gguf_name(name)
        qtype = Q4_K_M_TYPES[gguf_name.split(".")[-2]]
        raw[gguf_name] = (_q4_k_m_rows(qtype, rows, cols, generator),
                          gguf.GGMLQuantizationType[qtype])
    for i in range(config.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = \
                1 + generator.standard_normal(config.hidden_size).astype(np.float32) * 0.1
    tensors["model.norm.weight"] = np.ones(config.hidden_size, np.float32)
    write_gguf(path, config, tensors, raw_override=raw)
    return path


# ---- quantized KV rows: the int8 and fp8 caches (tests/test_kv_int8.py, tests/test_kv_fp8.py)
KV_HEADS_Q, KV_HEADS_KV = 6, 2  # query and KV heads of the kernel-level tests


def quantized_kv_batch(row_dtype, act_dtype, query_lens, seq_lens, dim, block_size=4, seed=1):
    """Scattered block tables, a cache of `row_dtype` rows (int8, or fp8 stored as uint8)
    holding quantized random K/V, random qkv in `act_dtype`."""
    import torch

    from kvserve.attention import build_attention_metadata
    from kvserve.kernels import reference

    torch.manual_seed(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    ids = torch.randperm(sum(blocks_needed) + 3).tolist()
    tables, cursor = [], 0
    for count in blocks_needed:
        tables.append(ids[cursor:cursor + count])
        cursor += count
    metadata, positions = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    values = torch.randn(2, len(ids), block_size, KV_HEADS_KV, dim) * 2
    kv_cache = reference.quantize_kv_rows(values.to(act_dtype), row_dtype)
    qkv = torch.randn(sum(query_lens), (KV_HEADS_Q + 2 * KV_HEADS_KV) * dim, dtype=act_dtype)
    return metadata, positions, kv_cache, qkv


def code_ordinals(codes):
    """Quantized codes -> their places in value order (neighbouring values differ by one): int8
    codes as they are; an fp8 e4m3 byte's magnitude bits grow with its value, so +-(bits & 0x7F)."""
    import torch

    if codes.dtype == torch.int8:
        return codes.int()
    magnitude = (codes & 0x7F).int()
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def assert_rope_and_cache_writes_the_reference_codes(compiled, row_dtype, act_dtype, dim):
    """The compiled writer gives the reference's rows: the same bytes from float32 activations;
    from bf16 ones RoPE may round differently and move a code to its neighbour (few do)."""
    import torch

    metadata, positions, kv_cache, qkv = quantized_kv_batch(row_dtype, act_dtype, [3, 1, 5],
                                                            [3, 9, 12], dim)
    qkv2, cache2 = rope_both(compiled, metadata, positions, kv_cache, qkv, KV_HEADS_Q,
                             KV_HEADS_KV, dim)
    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qkv.float(), qkv2.float(), atol=tol, rtol=tol)
    if act_dtype == torch.float32:  # the same float inputs: the same codes and scales
        assert torch.equal(kv_cache, cache2)
    else:
        diff = (code_ordinals(kv_cache[..., :dim]) - code_ordinals(cache2[..., :dim])).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.05
    written = kv_cache[0].view(-1, KV_HEADS_KV, dim + 4)[metadata.slot_mapping]
    assert written[..., :dim].ne(0).any()


def assert_paged_attention_matches_the_reference(compiled, row_dtype, act_dtype, dim, window,
                                                 softcap):
    """Decode rows, a chunk over cached context, a fresh prompt, a long decode: the kernel
    over quantized rows within float (or bf16) rounding of the reference over the same rows."""
    import torch

    from kvserve.kernels import reference

    query_lens, seq_lens = [1, 4, 6, 1, 1], [7, 10, 6, 33, 1]
    metadata, _, kv_cache, qkv = quantized_kv_batch(row_dtype, act_dtype, query_lens, seq_lens,
                                                    dim)
    seq_ids = torch.arange(len(query_lens), dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            KV_HEADS_Q, KV_HEADS_KV, dim, dim**-0.5, window, softcap)
    out = torch.zeros(qkv.shape[0], KV_HEADS_Q * dim, dtype=act_dtype)
    expected = torch.zeros(qkv.shape[0], KV_HEADS_Q * dim)
    compiled.paged_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv.float(), kv_cache, expected, *args)
    tol = 1e-4 if act_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def quantized_attention_error(compiled, row_dtype) -> tuple[float, float]:
    """The quantization's own error: the largest and the mean difference between attention
    over quantized rows (the kernel) and over the float values they came from (what the
    perplexity bounds measure on the real models)."""
    import torch

    from kvserve.kernels import reference

    torch.manual_seed(3)
    query_lens, seq_lens, dim = [1, 1, 8], [40, 90, 8], 64
    metadata, _, _, qkv = quantized_kv_batch(row_dtype, torch.float32, query_lens, seq_lens, dim)
    values = torch.randn(2, metadata.block_tables.max() + 1, 4, KV_HEADS_KV, dim)
    seq_ids = torch.arange(3, dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            KV_HEADS_Q, KV_HEADS_KV, dim, dim**-0.5, 0)
    exact, quantized = (torch.zeros(qkv.shape[0], KV_HEADS_Q * dim) for _ in range(2))
    reference.paged_attention_(qkv, values, exact, *args)
    compiled.paged_attention_(qkv, reference.quantize_kv_rows(values, row_dtype), quantized,
                              *args)
    error = (quantized - exact).abs()
    return float(error.max()), float(error.mean())


def assert_flash_path_reads_a_dequantized_copy(compiled, row_dtype, dim):
    """Prompt chunks take the flash kernel with bf16 activations; over a quantized cache it
    reads the sequences' blocks dequantized (PagedBackend), within bf16 rounding of the
    reference."""
    import pytest
    import torch

    from kvserve.attention.paged import PagedBackend
    from kvserve.kernels import reference

    if not compiled.flash_attention_supported(dim):
        pytest.skip(f"no flash kernel in the {compiled.isa} build")
    query_lens, seq_lens = [17, 1, 40, 5], [17, 50, 100, 9]
    metadata, _, kv_cache, qkv = quantized_kv_batch(row_dtype, torch.bfloat16, query_lens,
                                                    seq_lens, dim)
    out = PagedBackend(compiled).attend(qkv, kv_cache, metadata, KV_HEADS_Q, KV_HEADS_KV, dim,
                                        dim**-0.5)
    assert metadata.plan.flash_seq_ids.tolist() == [0, 2, 3]
    expected = torch.zeros(qkv.shape[0], KV_HEADS_Q * dim)
    reference.paged_attention_(qkv.float(), kv_cache, expected,
                               torch.arange(4, dtype=torch.int32),
                               metadata.query_start_loc.long(), metadata.seq_lens,
                               metadata.block_tables, KV_HEADS_Q, KV_HEADS_KV, dim, dim**-0.5, 0)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def assert_kernels_refuse_rows_of_the_wrong_width(compiled, row_dtype):
    import pytest
    import torch

    metadata, positions, kv_cache, qkv = quantized_kv_batch(row_dtype, torch.float32, [1], [5],
                                                            32)
    with pytest.raises(RuntimeError, match="row"):
        compiled.rope_and_cache_(qkv, positions, torch.randn(16, 32), kv_cache[..., :32].clone(),
                                 metadata.slot_mapping, KV_HEADS_Q, KV_HEADS_KV, 32)
    out = torch.zeros(1, KV_HEADS_Q * 32)
    with pytest.raises(RuntimeError, match="row"):
        compiled.paged_attention_(qkv, kv_cache[..., :32].clone(), out,
                                  torch.zeros(1, dtype=torch.int32),
                                  metadata.query_start_loc.long(), metadata.seq_lens,
                                  metadata.block_tables, KV_HEADS_Q, KV_HEADS_KV, 32, 0.1, 0)


def equal_up_to_near_ties(expected, got, near_tie: float, steps: int | None = None) -> list[int]:
    """Completion outputs (`expected` with logprobs >= 2) against others for the same prompts:
    each pair's tokens equal (the first `steps` of them, default all), or first different at a
    step where `expected`'s own top two logprobs were within `near_tie` nats. Returns how many
    leading tokens each pair shares."""
    shared = []
    for want, have in zip(expected, got):
        pairs = list(zip(want.token_ids, have.token_ids))[:steps]
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        shared.append(first)
        if first < len(pairs):
            top_two = sorted((p.logprob for p in want.logprobs[first].values()), reverse=True)
            assert top_two[0] - top_two[1] < near_tie, (first, top_two)
    return shared


def assert_chunked_prompts_give_their_tokens_again(model_dir, tokenizer, kv_cache_dtype,
                                                   near_tie: float = 0.0,
                                                   prefill_near_tie: float = 0.0):
    """float32 activations over a quantized cache: prompts chunked by a 32-token budget give
    the same greedy tokens when served again over their cached blocks (the same kernels read
    the same codes), up to a step where the first pass's top two were within `near_tie` nats,
    and begin as the prompts prefilled whole do (their first 4 tokens, up to a step where the
    whole prompt's top two were within `prefill_near_tie` nats: the two prefills round their
    own K/V, which differ in last bits, so their codes may differ). Not token for token to
    the end: the whole prompt's attention (SDPA) and the chunks' (the paged kernel) sum in
    different orders, and so do decode steps of other batch sizes; where float32 KV would
    differ in a last bit, a value near a rounding boundary can take the neighbouring code, and a
    near-tie then flips a later token (int8: seen on the AVX2 build at the 7th token of one
    prompt; float32 KV gives all 36 tokens equal there; fp8, whose codes are coarser: the 9th
    token of one prompt, at a margin of 0.022 nats)."""
    from kvserve import LLM, SamplingParams

    text = tokenizer.encode(long_text(), add_special_tokens=False)
    prompts = [{"prompt_token_ids": text[i * 90:(i + 1) * 90 + 40]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    common = dict(model=str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype,
                  block_size=16, num_kv_blocks=64, max_model_len=256, engine_core="thread")
    with LLM(enable_prefix_caching=False, **common) as whole:
        expected = [r.outputs[0] for r in whole.generate(prompts, params, use_tqdm=False)]
    with LLM(enable_prefix_caching=True, max_num_batched_tokens=32, **common) as chunked:
        first = [r.outputs[0] for r in chunked.generate(prompts, params, use_tqdm=False)]
        again = [r.outputs[0] for r in chunked.generate(prompts, params, use_tqdm=False)]
        assert chunked.llm_engine.engine_core.kv_manager.stats.hits > 0
    equal_up_to_near_ties(first, again, near_tie)
    equal_up_to_near_ties(expected, first, prefill_near_tie, steps=4)


def assert_blocks_go_to_a_ram_tier_and_come_back(model_dir, tokenizer, kv_cache_dtype):
    """Tiers copy whole blocks, codes and scales together: prefixes evicted from a small
    quantized pool come back from the RAM tier as cached tokens with the roomy pool's tokens;
    the small pool preempts too (requests computed again), with the same tokens."""
    from kvserve import LLM, SamplingParams

    words = tokenizer.encode(" ".join(f"word{i}" for i in range(600)), add_special_tokens=False)
    prompts = [{"prompt_token_ids": words[i * 80:(i + 1) * 80]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(model=str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype,
                  block_size=16, engine_core="thread")

    def run(engine, batch):
        return [engine.generate(p, params, use_tqdm=False)[0] for p in batch]

    with LLM(num_kv_blocks=256, enable_prefix_caching=False, **common) as roomy:
        expected = [o.outputs[0].token_ids for o in run(roomy, prompts)]
    with LLM(num_kv_blocks=16, max_model_len=128, kv_offload_ram_bytes=8 << 20,
             kv_offload_load_policy="always", **common) as small:
        first, again = run(small, prompts), run(small, prompts[:3])
        stats = small.llm_engine.engine_core.scheduler.connector.stats
        together = small.generate(prompts, params, use_tqdm=False)
        assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in first + again] == expected + expected[:3]
    assert [o.outputs[0].token_ids for o in together] == expected
    assert all(o.num_cached_tokens >= 64 for o in again)
    assert stats["loaded_blocks"] >= 12 and stats["failed_loads"] == 0


def sink_key_shift_errors(row_dtype):
    """Streaming's key shift (attention sinks) on quantized rows: keys written at p + 37 and
    rotated back against the keys written at p, each row's largest difference over its largest
    value; asserts the values kept their bytes."""
    import torch

    from kvserve.attention import build_attention_metadata
    from kvserve.attention.kv_tensors import allocate_kv_caches
    from kvserve.kernels import reference
    from kvserve.models import random_model
    from kvserve.testing.tiny import tiny_config

    model = random_model(tiny_config(), "float32", seed=0)
    caches = allocate_kv_caches(model.kv_page_layouts(row_dtype), 8, 16)
    model.bind_kv_cache(caches)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    for table, offset in (([0, 1, 2], 37), ([4, 5, 6], 0)):
        metadata, positions = build_attention_metadata([40], [40], [table], 16)
        model(ids, positions + offset, metadata)
    values = [cache[1].clone() for cache in caches]
    model.shift_keys([0, 1, 2], -37)
    errors = []
    for cache, before in zip(caches, values):
        shifted, written = (cache[0, blocks].flatten(0, 1)[:40] for blocks in ([0, 1, 2],
                                                                               [4, 5, 6]))
        keys = [reference.dequantize_kv_rows(k, torch.float32) for k in (shifted, written)]
        errors.append((keys[0] - keys[1]).abs().amax(-1) / keys[1].abs().amax(-1))
        assert torch.equal(cache[1], before)
    return torch.cat(errors)


def kv_cache_perplexities(source, row_dtype, act_dtype: str = "float32", max_windows: int = 2,
                          with_bos: bool = False) -> tuple[float, float]:
    """Perplexity on the held-out text (kvserve.bench.perplexity, windows of 512) over a KV
    cache in the activations' dtype and over quantized rows of `row_dtype`, the same model.
    `with_bos`: each window starts with the tokenizer's BOS (Gemma)."""
    import torch

    from kvserve.bench.perplexity import held_out_text, perplexity
    from kvserve.models import load_model
    from kvserve.tokenizer import load_tokenizer

    model, _ = load_model(source, act_dtype, attention_backend="paged")
    tokenizer = load_tokenizer(source)
    tokens = tokenizer.encode(held_out_text(), add_special_tokens=False)
    bos = tokenizer.bos_token_id if with_bos else None
    return tuple(perplexity(model, tokens, max_windows=max_windows, kv_dtype=kv_dtype,
                            bos_token_id=bos)["perplexity"]
                 for kv_dtype in (getattr(torch, act_dtype), row_dtype))


# ---- tensor- and expert-parallel runs (test_tensor_parallel.py, test_expert_parallel.py) --

# heads, KV heads and MLP width divide by the world size, and each rank's o_proj/down_proj slice
# is a multiple of 32 input features (int4 groups)
TP_CONFIGS = {
    2: dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128),
    3: dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192),
}
TP_VOCAB = 1000  # not a multiple of 3: the last vocabulary shard is padded
TP_PROMPTS = [[(11 * i + 7 * j) % (TP_VOCAB - 10) + 5 for j in range(3 + 2 * i)]
              for i in range(16)]
TP_DECODE_STEPS = 4
# ragged_run's logits rows of prompt tokens (no greedy token fed back): the first step's, and
# the second step's for the prompts finished in two chunks
TP_PROMPT_ROWS = [*range(len(TP_PROMPTS)), *range(len(TP_PROMPTS) * 3 // 2,
                                                 2 * len(TP_PROMPTS))]


def ragged_run(model, prompts: list[list[int]] | None = None,
               decode_steps: int = TP_DECODE_STEPS,
               between_steps=lambda step: None):
    """Greedy tokens and every step's last-position logits over: the first half of the prompts
    whole beside the first halves of the others; then decodes of the first half beside the
    other halves' second chunks; then `decode_steps` decodes of all. `between_steps(n)` runs
    after step n (from 1)."""
    import torch

    from kvserve.models.paged_loop import PagedLoop

    prompts = TP_PROMPTS if prompts is None else prompts
    count = len(prompts)
    loop = PagedLoop(model, count, max(len(p) for p in prompts) + decode_steps + 2)
    first, rest, everyone = range(count // 2), range(count // 2, count), list(range(count))
    halves = {i: len(prompts[i]) // 2 for i in rest}
    chunks = [prompts[i] for i in first] + [prompts[i][: halves[i]] for i in rest]
    lengths = [len(prompts[i]) for i in first] + [halves[i] for i in rest]
    step_logits = [torch.stack(loop.step(chunks, lengths, everyone))]
    between_steps(1)
    tokens = [[int(step_logits[0][i].argmax())] for i in first]
    chunks = [[t[-1]] for t in tokens] + [prompts[i][halves[i]:] for i in rest]
    lengths = [len(prompts[i]) + 1 for i in first] + [len(prompts[i]) for i in rest]
    step_logits.append(torch.stack(loop.step(chunks, lengths, everyone)))
    between_steps(2)
    tokens = [t + [int(step_logits[1][i].argmax())] for i, t in enumerate(tokens)]
    tokens += [[int(step_logits[1][i].argmax())] for i in rest]
    for _ in range(decode_steps):
        lengths = [len(prompts[i]) + len(tokens[i]) for i in everyone]
        logits = torch.stack(loop.step([[t[-1]] for t in tokens], lengths, everyone))
        step_logits.append(logits)
        between_steps(len(step_logits))
        tokens = [t + [int(logits[i].argmax())] for i, t in enumerate(tokens)]
    return tokens, torch.cat(step_logits)


def deepseek_ep_config(world_size: int, vocab_size: int = TP_VOCAB):
    """A tiny DeepSeek-V3 for expert parallelism (8 routed experts in 4 groups, a shared
    expert, a dense first layer), shaped for `world_size` tensor-parallel ranks."""
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=vocab_size, **TP_CONFIGS[world_size], num_hidden_layers=3,
        moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        initializer_range=0.2)


# ---- block-scaled fp8 checkpoints (DeepSeek-V3's, Qwen3-FP8's layout) ----------------------

def _is_fp8_quantized(name: str, tensor) -> bool:
    """What DeepSeek's fp8 checkpoints quantize: every projection in the decoder layers (the
    router, norms, embedding and LM head stay float)."""
    return tensor.dim() == 2 and name.startswith("model.layers.") and \
        not name.endswith("mlp.gate.weight")


def write_fp8_checkpoint(source, target, block=(128, 128), drop_scale: str | None = None,
                         bad_scale: str | None = None, keep_float: str = "") -> None:
    """`source`'s float checkpoint as a block-scaled fp8 one in `target` (optionally with one
    scale missing or of the wrong shape, or the projections named with `keep_float` left
    float)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvserve.weights.fp8_checkpoint import quantize_fp8_blocks

    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        file.unlink()
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not _is_fp8_quantized(name, tensor) or (keep_float and keep_float in name):
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
