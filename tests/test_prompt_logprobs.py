"""Prompt logprobs (SamplingParams.prompt_logprobs; echo + logprobs on /v1/completions; what
lm-evaluation-harness scores): each prompt token's logprob from the position before it,
exact against HF transformers' forward in float32 - in one step, in chunks, with the prefix
already cached, beside requests that do not ask."""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.helpers import long_text

pytestmark = pytest.mark.slow

ATOL = 1e-4


def _hf_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: HF's log-softmax at positions 0..len-2 (each scores the next token)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _assert_matches_hf(output, hf_model, num_top: int) -> None:
    prompt = output.prompt_token_ids
    expected = _hf_prompt_logprobs(hf_model, prompt)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, entry in enumerate(got[1:]):
        token = prompt[position + 1]
        row = expected[position]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=ATOL)
        # the rank counts tokens strictly more likely: tokens within the tolerance may fall
        # either side
        surely_above = int((row > row[token] + ATOL).sum())
        maybe_above = int((row > row[token] - ATOL).sum())
        assert surely_above + 1 <= entry[token].rank <= maybe_above + 1
        top = sorted(lp.logprob for lp in entry.values() if lp.rank <= num_top)[::-1]
        assert top == pytest.approx(row.topk(num_top).values.tolist(), abs=ATOL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    text = long_text()
    return [tokenizer.encode(text)[:length] for length in (2, 9, 70, 150)] + \
        [tokenizer.encode("The capital of France is Paris. The capital of Italy is")]


@pytest.fixture(scope="module")
def llm_for():
    """SmolLM2 in float32 with the prefix cache on, one engine per step size (None: a prompt in
    one step), each loaded on first use and shared by the tests below: a real model load
    each, not one per test."""
    opened = {}

    def llm(chunk: int | None):
        if chunk not in opened:
            options = dict(max_num_batched_tokens=chunk) if chunk else {}
            opened[chunk] = LLM(dtype="float32", max_model_len=1024, enable_prefix_caching=True,
                                **options)
        return opened[chunk]

    yield llm
    for engine in opened.values():
        engine.shutdown()


@pytest.mark.parametrize("chunk", [None, 32], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_hf(hf_model, prompts, chunk, llm_for):
    """Batched with a request that does not ask; the long prompts span several 32-token
    chunks; the prompt repeated after it was cached is recomputed and scores the same."""
    llm = llm_for(chunk)
    asks = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=2, temperature=0)
    outputs = llm.generate(prompts + [prompts[3]], [asks] * len(prompts) + [plain],
                           use_tqdm=False)
    assert outputs[-1].prompt_logprobs is None
    for output in outputs[:-1]:
        _assert_matches_hf(output, hf_model, 3)
    again = llm.generate([prompts[3], prompts[2]], asks, use_tqdm=False)
    for output in again:  # recomputed, not read from the cache
        assert output.num_cached_tokens == 0
        _assert_matches_hf(output, hf_model, 3)


def test_prompt_logprobs_leave_samples_unchanged(prompts, llm_for):
    """Asking for prompt logprobs changes no sampled token; n > 1 scores the prompt once."""
    llm = llm_for(None)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    asked = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                 prompt_logprobs=0), use_tqdm=False)
    several = llm.generate(prompts[2], SamplingParams(max_tokens=3, n=2, temperature=0,
                                                      prompt_logprobs=1), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in asked] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in asked)
    # prompt_logprobs=0: the prompt token's own entry only
    assert all(len(entry) == 1 for o in asked for entry in o.prompt_logprobs[1:])
    assert len(several[0].prompt_logprobs) == len(prompts[2])


def test_prompt_logprobs_validated():
    from kvserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# ---- over HTTP: echo + logprobs + max_tokens 0, vLLM's prompt_logprobs, lm-eval ---------------
@pytest.fixture(scope="module")
def fp32_server(tmp_path_factory):
    """SmolLM2 in float32 with 32-token steps, so long prompts arrive in chunks."""
    from kvserve.testing.server import ServerProcess

    log = tmp_path_factory.mktemp("fp32-server") / "server.log"
    with ServerProcess(["--dtype", "float32", "--max-model-len", "1024",
                        "--served-model-name", "smol", "--max-num-batched-tokens", "32"],
                       log_path=log) as server:
        yield server
    assert server.exit_code == 0, log.read_text()[-3000:]


def test_echo_logprobs_score_the_prompt_over_http(fp32_server, hf_model, prompts):
    """lm-eval's request (token ids, echo, logprobs, max_tokens 0 or 1): the prompt's token
    logprobs equal HF's, cached prompts included; nothing is generated with max_tokens 0."""
    import openai

    client = openai.OpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="none")
    for max_tokens in (0, 1, 0):  # the second 0 runs on prompts the cache holds
        reply = client.completions.create(model="smol", prompt=prompts[1:], max_tokens=max_tokens,
                                          echo=True, logprobs=2, temperature=0)
        assert reply.usage.completion_tokens == max_tokens * len(prompts[1:])
        for choice, prompt in zip(reply.choices, prompts[1:]):
            expected = _hf_prompt_logprobs(hf_model, prompt)
            got = choice.logprobs.token_logprobs
            assert len(got) == len(prompt) + max_tokens and got[0] is None
            assert got[1:len(prompt)] == pytest.approx(
                expected.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist(),
                abs=ATOL)
            assert choice.logprobs.top_logprobs[0] is None
            assert max(choice.logprobs.top_logprobs[-1 - max_tokens].values()) == \
                pytest.approx(float(expected[-1].max()), abs=ATOL)
            assert choice.finish_reason == "length"
        if max_tokens == 0:
            assert [c.text for c in reply.choices] == \
                [client.completions.create(model="smol", prompt=p, max_tokens=1, echo=True,
                                           temperature=0).choices[0].text[:len(c.text)]
                 for p, c in zip(prompts[1:], reply.choices)]


def test_echo_logprobs_stream_as_returned_whole(fp32_server, prompts):
    import openai

    client = openai.OpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="none")
    whole = client.completions.create(model="smol", prompt=prompts[2], max_tokens=3, echo=True,
                                      logprobs=1, temperature=0).choices[0]
    chunks = list(client.completions.create(model="smol", prompt=prompts[2], max_tokens=3,
                                            echo=True, logprobs=1, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_vllm_prompt_logprobs_field(fp32_server, hf_model, prompts):
    """`prompt_logprobs` on completions (per choice) and chat (top level), in vLLM's shape."""
    import httpx

    body = {"model": "smol", "prompt": prompts[1], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    choice = httpx.post(f"{fp32_server.base_url}/v1/completions", json=body,
                        timeout=60).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    expected = _hf_prompt_logprobs(hf_model, prompts[1])
    assert scored[0] is None and len(scored) == len(prompts[1])
    for position, entry in enumerate(scored[1:]):
        token = prompts[1][position + 1]
        assert entry[str(token)]["logprob"] == pytest.approx(float(expected[position, token]),
                                                             abs=ATOL)
        assert len(entry) <= 3
    assert choice["logprobs"] is None  # the sample's logprobs were not asked for
    chat = httpx.post(f"{fp32_server.base_url}/v1/chat/completions", json={
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    bad = httpx.post(f"{fp32_server.base_url}/v1/completions",
                     json={**body, "prompt_logprobs": 21}, timeout=60)
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


_TASK = """task: kvserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

_ITEMS = [("The capital of France is", [" Paris", " Berlin", " Rome"], 0),
          ("Two plus two equals", [" five", " four", " seven"], 1),
          ("The sky on a clear day is", [" green", " loud", " blue"], 2),
          ("Water freezes at zero degrees", [" Celsius", " Kelvin", " miles"], 0),
          ("A week has seven", [" days", " cats", " hours"], 0),
          ("The opposite of hot is", [" warm", " cold", " red"], 1)]


def _lm_eval(model: str, model_args: dict, task_dir) -> tuple[float, list[list[float]]]:
    """(accuracy, each item's choice loglikelihoods) of the tiny task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                      tasks=["kvserve_tiny_mc"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(task_dir)))
    samples = sorted(results["samples"]["kvserve_tiny_mc"], key=lambda s: s["doc_id"])
    return (results["results"]["kvserve_tiny_mc"]["acc,none"],
            [[float(r[0][0]) for r in s["resps"]] for s in samples])


def _save_plain_hf(hf_model, directory) -> None:
    """The GGUF-loaded reference as a plain float32 HF directory (transformers does not save a
    model it dequantized from GGUF)."""
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(hf_model)(config)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(directory)


def test_lm_eval_local_completions_equal_its_hf_backend(fp32_server, hf_model, hf_tokenizer,
                                                       tmp_path):
    """lm-evaluation-harness's loglikelihood task from a local JSON dataset: kvserve serve
    through `local-completions` scores every choice as lm-eval's own HF backend does."""
    import json

    pytest.importorskip("lm_eval")
    hf_dir = tmp_path / "smollm2-hf"
    _save_plain_hf(hf_model, hf_dir)
    hf_tokenizer.save_pretrained(hf_dir)
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in _ITEMS))
    (tmp_path / "task.yaml").write_text(_TASK.format(data=data))
    served = _lm_eval("local-completions", {
        "model": "smol", "base_url": f"{fp32_server.base_url}/v1/completions",
        "tokenizer_backend": "huggingface", "tokenizer": str(hf_dir), "batch_size": 4,
        "max_retries": 1}, tmp_path)
    reference = _lm_eval("hf", {"pretrained": str(hf_dir), "dtype": "float32",
                                "device": "cpu"}, tmp_path)
    assert served[0] == reference[0]
    assert len(served[1]) == len(_ITEMS)
    for ours, theirs in zip(served[1], reference[1]):
        assert ours == pytest.approx(theirs, abs=1e-3)
