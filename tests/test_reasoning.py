"""Reasoning parsers (--reasoning-parser deepseek_r1 | qwen3): a reply's thinking split from
its answer, whole and streamed token by token (SmolLM2's tokenizer writes `</think>` as three
tokens, so the tag arrives split), the prompt deciding whether a reply starts inside its
thinking; the thinking budget (a built-in logits processor) batched, under speculative
verification and over HTTP; structured output and tool calls applied to the answer after the
thinking. End to end on a tiny random model with the real Qwen3 and DeepSeek-R1-distill chat
templates (as llama.cpp's tree keeps them), its replies written by ForceTokens while the model
runs, read through the official `openai` client and LangChain."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvserve.entrypoints.openai.reasoning.grammar import after_thinking
from kvserve.entrypoints.openai.reasoning.parser import (
    ReasoningStream,
    ThinkingPlan,
    split_reasoning,
    template_warnings,
    thinking_plan,
)
from kvserve.sample.logits_processor import AddedRow, BatchUpdate
from kvserve.sample.thinking_budget import ThinkingBudgetProcessor
from kvserve.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    ThinkingMarkers,
)
from tests.helpers import llama_cpp_chat_template, streamed_response, tiny_server_flags

openai = pytest.importorskip("openai")

QWEN3, R1 = "Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
THOUGHT = "The user greets me, so I should greet back {not JSON yet} and offer help."
ANSWER = "Hello! How can I help you today?"
QWEN3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
R1_REPLY = f"{THOUGHT}\n</think>\n\n{ANSWER}"  # the prompt opened the thinking
INSIDE, MAY_THINK = ThinkingPlan(inside=True), ThinkingPlan(inside=False)
HELLO = [{"role": "user", "content": "Hello!"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}},
           "required": ["verdict"], "additionalProperties": False}


def _streamed(tokenizer, text: str, plan: ThinkingPlan) -> list[dict]:
    """The deltas of `text` fed token by token, as the server decodes it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream, deltas = ReasoningStream(plan), []
    for end in range(1, len(ids) + 1):
        deltas += stream.feed(tokenizer.decode(ids[:end]), end == len(ids))
    return deltas


def _joined(deltas: list[dict], key: str) -> str | None:
    return "".join(delta.get(key, "") for delta in deltas) or None


# ---- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,plan,expected", [
    (QWEN3_REPLY, MAY_THINK, (f"\n{THOUGHT}\n", f"\n\n{ANSWER}")),
    (R1_REPLY, INSIDE, (f"{THOUGHT}\n", f"\n\n{ANSWER}")),
    ("<think>" + R1_REPLY, INSIDE, (f"{THOUGHT}\n", f"\n\n{ANSWER}")),  # R1 opening it again
    (ANSWER, MAY_THINK, (None, ANSWER)),  # Qwen3 answering without thinking
    (f"\n<think>{THOUGHT}", MAY_THINK, (THOUGHT, None)),  # cut by max_tokens while thinking
    (f"{THOUGHT} </thi", INSIDE, (f"{THOUGHT} </thi", None)),  # cut inside the close
    ("<think></think>" + ANSWER, MAY_THINK, (None, ANSWER)),
])
def test_whole_and_streamed_token_by_token_give_the_same_split(tokenizer, text, plan,
                                                                expected):
    """The close tag is three tokens here: streamed, no delta ever holds a piece of a tag,
    and the deltas put together are the whole reply's fields."""
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) == 3
    assert split_reasoning(text, plan) == expected
    deltas = _streamed(tokenizer, text, plan)
    reasoning, answer = expected
    assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == \
        (reasoning, answer or None)
    if "</think>" in text:
        pieces = [next(iter(delta.values())) for delta in deltas]
        assert all("<" not in piece and "think>" not in piece for piece in pieces), deltas


def test_the_prompt_says_whether_a_reply_starts_inside_its_thinking(tokenizer):
    """Qwen3's template leaves the opening to the model, or closes the thinking itself with
    enable_thinking false; the DeepSeek-R1 distill's (llama.cpp's copy) opens it, or closes
    it unless enable_thinking is true; without a think-tag parser nothing is split."""
    def plan(name, parser, **kwargs):
        prompt = tokenizer.apply_chat_template(HELLO, True, llama_cpp_chat_template(name),
                                               **kwargs)
        return thinking_plan(parser, prompt, kwargs)

    assert plan(QWEN3, "qwen3") == MAY_THINK
    assert plan(QWEN3, "qwen3", enable_thinking=True) == MAY_THINK
    assert plan(QWEN3, "qwen3", enable_thinking=False) is None
    assert plan(R1, "deepseek_r1", enable_thinking=True) == INSIDE
    assert plan(R1, "deepseek_r1") is None  # this copy of the template closes it by default
    assert thinking_plan("deepseek_r1", "<|User|>Hi<|Assistant|>", {}) == INSIDE  # vLLM's rule
    assert plan(QWEN3, None) is None and plan(QWEN3, "gpt_oss") is None


def test_a_parser_that_does_not_fit_the_template_is_warned_about(tokenizer):
    assert template_warnings("qwen3", llama_cpp_chat_template(QWEN3)) == []
    assert template_warnings("deepseek_r1", llama_cpp_chat_template(R1)) == []
    assert template_warnings(None, tokenizer.chat_template) == []
    [warning] = template_warnings("qwen3", tokenizer.chat_template)
    assert "never writes <think>" in warning
    [warning] = template_warnings("gpt_oss", llama_cpp_chat_template(QWEN3))
    assert "does not write harmony" in warning
    [warning] = template_warnings("deepseek_r1", llama_cpp_chat_template("openai-gpt-oss-120b"))
    assert "--reasoning-parser gpt_oss" in warning


# ---- the grammar after the thinking -------------------------------------------------------------
@pytest.mark.parametrize("plan", [INSIDE, MAY_THINK], ids=["inside", "may-think"])
def test_structured_output_constrains_the_answer_and_leaves_the_thinking_free(tokenizer, plan):
    """xgrammar's matcher over the vocabulary: any thinking (JSON-breaking braces included) up
    to </think>, then only what the schema allows; a model that may think may also answer at
    once."""
    from kvserve.structured_output.backend import tokenizer_info, xgrammar
    from kvserve.structured_output.compiler import build_grammar

    xgr = xgrammar()
    info = tokenizer_info(tokenizer, tokenizer.vocab_size)
    spec = after_thinking(StructuredOutputsParams(json=VERDICT), plan)
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(spec))
    opening = "" if plan.inside else "<think>"
    allowed = [f'{opening}{THOUGHT}</think>\n\n{{"verdict": "yes"}}',
               f'{opening}</think>{{"verdict":"no"}}']
    refused = [f"{opening}{THOUGHT}</think>\n\n{ANSWER}",
               f'{opening}{THOUGHT}</think>\n\n{{"verdict": "maybe"}}']
    allowed += [] if plan.inside else ['{"verdict": "no"}']
    for text in allowed:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text), text
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated(), text
    for text in refused:
        matcher = xgr.GrammarMatcher(compiled)
        assert not (matcher.accept_string(text) and matcher.accept_token(
            tokenizer.eos_token_id)), text


# ---- the thinking budget ---------------------------------------------------------------------
def _markers(tokenizer, inside: bool) -> ThinkingMarkers:
    return ThinkingMarkers(tokenizer.encode("<think>", add_special_tokens=False),
                           tokenizer.encode("</think>", add_special_tokens=False), inside)


def test_the_budget_closes_the_thinking_at_n_tokens_batched_with_others(tiny_llm, tokenizer):
    """One batch, greedy: each budgeted request thinks exactly its budget of tokens (what it
    would have written), then writes </think>'s tokens and goes on; the same prompt without a
    budget, and one whose reply never opens thinking, write what they write alone."""
    prompt = tokenizer.encode("Think about the weather in Paris, then answer.")
    close = tokenizer.encode("</think>", add_special_tokens=False)

    def params(budget=None, inside=True):
        return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                              thinking_token_budget=budget,
                              thinking=_markers(tokenizer, inside) if budget is not None
                              else None)

    alone = tiny_llm.generate([prompt], params())[0].outputs[0].token_ids
    batch = [params(), params(0), params(3), params(7), params(2, inside=False)]
    outputs = [o.outputs[0].token_ids for o in tiny_llm.generate([prompt] * len(batch), batch)]
    assert outputs[0] == alone and outputs[4] == alone  # never opened: untouched
    for budget, output in zip((0, 3, 7), outputs[1:4]):
        assert output[:budget] == alone[:budget]
        assert output[budget:budget + len(close)] == close
        assert len(output) == 16


def test_the_budget_steps_back_with_a_speculative_steps_rejected_tokens(tokenizer):
    """Verification appends each depth's token to the output and takes the rejected ones off
    again: the processor's count follows the list both ways, so the close comes at the same
    position as without drafts."""
    close = tokenizer.encode("</think>", add_special_tokens=False)
    processor = ThinkingBudgetProcessor()
    output: list[int] = []
    params = SamplingParams(thinking_token_budget=4, thinking=_markers(tokenizer, False))
    processor.update_state(BatchUpdate(1, added=[AddedRow(0, params, [1], output)]))
    logits = torch.zeros(1, tokenizer.vocab_size)

    def forced() -> int | None:
        row = processor.apply(logits.clone())[0]
        return int(row.argmax()) if torch.isinf(row).sum() == row.numel() - 1 else None

    opened = _markers(tokenizer, False).start_token_ids
    output += opened + [100, 101, 102]
    assert forced() is None  # 3 tokens of thinking
    output += [103, 104, 105]  # a draft run past the budget, then rejected
    assert forced() == close[0]
    del output[len(opened) + 3:]
    processor.update_state(None)
    assert forced() is None
    output.append(103)
    for token in close:
        assert forced() == token
        output.append(token)
    processor.update_state(None)
    assert not processor.is_active()  # closed: the row costs nothing more


def test_a_budget_needs_its_markers():
    from kvserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=5)
    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1, thinking=ThinkingMarkers([1], [2]))


# ---- end to end -------------------------------------------------------------------------------
def _model_dir(tmp_path_factory, tokenizer, template: str | None):
    """The tiny random model with SmolLM2's tokenizer and the named model's chat template."""
    from kvserve.testing.tiny import write_tiny_model_dir

    directory = write_tiny_model_dir(tmp_path_factory.mktemp("reasoning"), tokenizer)
    if template is not None:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = llama_cpp_chat_template(template)
        config_path.write_text(json.dumps(config))
    return directory


def _serve(tmp_path_factory, directory, *flags):
    from kvserve.testing.server import ServerProcess

    log = tmp_path_factory.mktemp("log") / "server.log"
    server = ServerProcess(tiny_server_flags(directory, "--served-model-name", "thinker",
                                             "--logits-processors",
                                             "kvserve.testing.logits_processors:ForceTokens",
                                             *flags), log_path=log)
    return server, log


# each server: its chat template, its flags
SERVERS = {"qwen3": (QWEN3, ("--reasoning-parser", "qwen3")),
           "deepseek": (R1, ("--reasoning-parser", "deepseek_r1")),
           "no-parser": (QWEN3, ()),
           "misfit": (None, ("--reasoning-parser", "qwen3"))}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tokenizer):
    """The module's four servers, launched together so their starts (mostly Python imports, one
    core each) overlap; each test's fixture or body enters its own (waits for /health) and
    stops it. Any left running stop with the module."""
    started = {}
    for name, (template, flags) in SERVERS.items():
        started[name] = _serve(tmp_path_factory, _model_dir(tmp_path_factory, tokenizer,
                                                            template), *flags)
        started[name][0].start()
    yield started
    for server, _ in started.values():
        server.stop()


@pytest.fixture(scope="module")
def qwen3(servers):
    server, log = servers["qwen3"]
    with server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused"), log
    assert "outside its grammar" not in log.read_text()


@pytest.fixture(scope="module")
def deepseek(servers):
    server, _ = servers["deepseek"]
    with server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def _forced(tokenizer, text: str, end: bool = True, **extra) -> dict:
    """The request's reply written for it: `text`, then EOS (unless the model is to go on)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"vllm_xargs": {"force_tokens": ids + ([tokenizer.eos_token_id] if end else [])},
            **extra}


def _chat(client, tokenizer, reply: str, **request):
    request = {"model": "thinker", "messages": HELLO, "max_tokens": 120, "temperature": 0,
               **request}
    request["extra_body"] = {**_forced(tokenizer, reply), **request.get("extra_body", {})}
    return client.chat.completions.create(**request)


def _stream_fields(client, tokenizer, reply: str, **request) -> tuple[dict, list[dict]]:
    """Each field's deltas put together (reasoning, reasoning_content, content, tool calls'
    arguments), the finish reason, and every delta's extra fields."""
    fields = {"reasoning": "", "reasoning_content": "", "content": "", "arguments": "",
              "finish": None}
    extras = []
    for chunk in _chat(client, tokenizer, reply, stream=True, **request):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            extras.append(extra)
            for key in ("reasoning", "reasoning_content"):
                fields[key] += extra.get(key) or ""
            fields["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                fields["arguments"] += call.function.arguments or ""
            fields["finish"] = choice.finish_reason or fields["finish"]
    return fields, extras


def test_reasoning_and_content_through_the_openai_client(qwen3, tokenizer):
    """Qwen3's reply: its thinking as reasoning_content (and vLLM's newer `reasoning`), the
    answer as content; streamed token by token (the close tag split over three tokens), the
    deltas add up to the same fields and none carries a piece of a tag."""
    client, _ = qwen3
    choice = _chat(client, tokenizer, QWEN3_REPLY).choices[0]
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == f"\n{THOUGHT}\n"
    assert choice.message.content == f"\n\n{ANSWER}" and choice.finish_reason == "stop"
    fields, extras = _stream_fields(client, tokenizer, QWEN3_REPLY)
    assert fields["reasoning_content"] == fields["reasoning"] == f"\n{THOUGHT}\n"
    assert (fields["content"], fields["finish"]) == (f"\n\n{ANSWER}", "stop")
    pieces = [extra.get("reasoning_content") for extra in extras if extra.get("reasoning")]
    assert len(pieces) > 5 and all("<" not in piece and ">" not in piece for piece in pieces)


def test_deepseek_r1_replies_start_inside_the_thinking(deepseek, tokenizer):
    """The R1 distill's template (llama.cpp's copy) opens the thinking in the prompt when
    enable_thinking is true: the reply has no <think>, its text up to </think> is the
    reasoning. Without it, that template closes the thinking itself: all content."""
    thinking_on = {"chat_template_kwargs": {"enable_thinking": True}}
    choice = _chat(deepseek, tokenizer, R1_REPLY, extra_body=thinking_on).choices[0]
    assert choice.message.model_extra["reasoning_content"] == f"{THOUGHT}\n"
    assert choice.message.content == f"\n\n{ANSWER}"
    fields, _ = _stream_fields(deepseek, tokenizer, R1_REPLY, extra_body=thinking_on)
    assert (fields["reasoning_content"], fields["content"]) == (f"{THOUGHT}\n", f"\n\n{ANSWER}")
    closed = _chat(deepseek, tokenizer, R1_REPLY).choices[0].message
    assert (closed.content, closed.model_extra.get("reasoning_content")) == (R1_REPLY, None)


def test_enable_thinking_reaches_the_template_only_in_chat_template_kwargs(qwen3, tokenizer):
    """enable_thinking false: Qwen3's template writes an empty thinking into the prompt (the
    prompt grows by its tokens) and the reply is all content, as vLLM reads it. At the top
    level of the body (not vLLM's place for it) it is a 400 naming it."""
    client, _ = qwen3
    on = _chat(client, tokenizer, QWEN3_REPLY)
    off = _chat(client, tokenizer, QWEN3_REPLY,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    empty_thinking = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == len(empty_thinking)
    assert off.choices[0].message.content == QWEN3_REPLY
    assert "reasoning_content" not in off.choices[0].message.model_extra
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):
        _chat(client, tokenizer, QWEN3_REPLY, extra_body={"enable_thinking": False})


def test_include_reasoning_false_sends_the_answer_alone(qwen3, tokenizer):
    client, _ = qwen3
    message = _chat(client, tokenizer, QWEN3_REPLY,
                    extra_body={"include_reasoning": False}).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (f"\n\n{ANSWER}",
                                                                           None)
    fields, _ = _stream_fields(client, tokenizer, QWEN3_REPLY,
                               extra_body={"include_reasoning": False})
    assert (fields["reasoning_content"], fields["content"]) == ("", f"\n\n{ANSWER}")


def test_a_tool_call_after_the_thinking_parses(qwen3, tokenizer):
    """The tool parser reads the answer after </think>: the call comes back as tool_calls
    with the thinking as reasoning_content, whole and streamed (the tools' grammar moved
    after the thinking accepted every token: the fixture checks the log)."""
    client, _ = qwen3
    reply = f"<think>\nParis weather: call the tool.\n</think>\n\n{CALL}"
    choice = _chat(client, tokenizer, reply, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "\nParis weather: call the tool.\n"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    fields, _ = _stream_fields(client, tokenizer, reply, tools=[WEATHER])
    assert fields["reasoning_content"] == "\nParis weather: call the tool.\n"
    # streamed, the text before a call goes out as written (as without thinking)
    assert (fields["content"].strip(), fields["finish"]) == ("", "tool_calls")
    assert json.loads(fields["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output_applies_to_the_answer_after_the_thinking(qwen3, tokenizer, stream):
    """The thinking (forced, braces and all) is free; after </think> the model itself writes
    the answer under the schema's grammar, which validates."""
    client, _ = qwen3
    thinking = f"<think>\n{THOUGHT}\n</think>"
    request = dict(response_format={"type": "json_schema", "json_schema": {
        "name": "verdict", "schema": VERDICT}},
        extra_body=_forced(tokenizer, thinking, end=False))
    if stream:
        fields, _ = _stream_fields(client, tokenizer, thinking, **request)
        reasoning, content = fields["reasoning_content"], fields["content"]
    else:
        message = _chat(client, tokenizer, thinking, **request).choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
    assert reasoning == f"\n{THOUGHT}\n"
    jsonschema.validate(json.loads(content), VERDICT)


def test_the_budget_closes_the_thinking_over_http(qwen3, tokenizer):
    """thinking_token_budget: after <think> the random model thinks freely for exactly the
    budget's tokens, then </think>'s tokens come (forced), then its answer."""
    client, _ = qwen3
    opened = tokenizer.encode("<think>", add_special_tokens=False)
    close = tokenizer.encode("</think>", add_special_tokens=False)
    response = client.chat.completions.create(
        model="thinker", messages=HELLO, max_tokens=24, temperature=0, logprobs=True,
        extra_body={**_forced(tokenizer, "<think>", end=False), "thinking_token_budget": 6,
                    "ignore_eos": True})
    tokens = [entry.token for entry in response.choices[0].logprobs.content]
    assert tokens[len(opened) + 6:len(opened) + 6 + len(close)] == \
        [tokenizer.decode([token]) for token in close]
    reasoning = response.choices[0].message.model_extra["reasoning_content"]
    assert "think>" not in reasoning + (response.choices[0].message.content or "")
    assert response.usage.completion_tokens == 24


def test_responses_reasoning_items_whole_and_streamed(qwen3, tokenizer):
    """The Responses API: a reasoning item (its text as reasoning text), then the message
    (stripped, as output_text); streamed, the reasoning_text deltas and the text deltas
    rebuild the same and the completed response holds the same items."""
    client, _ = qwen3
    request = dict(model="thinker", input="Hello!", max_output_tokens=120,
                   extra_body=_forced(tokenizer, QWEN3_REPLY))
    response = client.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == f"\n{THOUGHT}\n"
    assert response.output_text == ANSWER
    deltas, completed = streamed_response(client, **request)
    thought = deltas["response.reasoning_text.delta"]
    assert (thought, deltas["response.output_text.delta"]) == (f"\n{THOUGHT}\n", ANSWER)
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert completed.output[0].content[0].text == thought


def test_langchain_reads_the_answer_and_the_reasoning(qwen3, tokenizer):
    """LangChain's ChatOpenAI: over chat completions its content is the answer alone (the
    thinking is not in it); over the Responses API the reasoning comes as a reasoning block
    beside the text."""
    langchain_openai = pytest.importorskip("langchain_openai")
    client, _ = qwen3
    common = dict(model="thinker", base_url=str(client.base_url), api_key="unused",
                  temperature=0, max_tokens=120, extra_body=_forced(tokenizer, QWEN3_REPLY))
    chat = langchain_openai.ChatOpenAI(**common)
    assert chat.invoke("Hello!").content == f"\n\n{ANSWER}"
    assert "".join(chunk.content for chunk in chat.stream("Hello!")) == f"\n\n{ANSWER}"
    responses = langchain_openai.ChatOpenAI(**common, use_responses_api=True,
                                            output_version="v1")
    blocks = responses.invoke("Hello!").content_blocks
    assert [block["type"] for block in blocks] == ["reasoning", "text"], blocks
    # LangChain reads reasoning summaries into `reasoning`; reasoning text stays as sent
    assert blocks[0]["extras"]["content"] == [{"type": "reasoning_text",
                                               "text": f"\n{THOUGHT}\n"}]
    assert blocks[1]["text"] == ANSWER


def test_without_the_flag_the_thinking_stays_in_the_content(servers, tokenizer):
    """As vLLM: no --reasoning-parser, no split (and a budget has nothing to count: 400)."""
    server, _ = servers["no-parser"]
    with server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        message = _chat(client, tokenizer, QWEN3_REPLY).choices[0].message
        assert message.content == QWEN3_REPLY
        assert "reasoning_content" not in message.model_extra
        with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
            _chat(client, tokenizer, QWEN3_REPLY, extra_body={"thinking_token_budget": 4})


def test_a_parser_the_template_does_not_fit_is_warned_about_at_start(servers):
    server, log = servers["misfit"]
    with server:
        from tests.helpers import wait_until

        wait_until(lambda: "never writes <think>" in log.read_text(), timeout=10)
