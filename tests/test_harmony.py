"""gpt-oss's harmony format (kvserve/entrypoints/openai/harmony.py): its chat template (the one
gpt-oss's Hugging Face repository ships, as llama.cpp's tree keeps it) renders as HF
transformers renders it; a reply's channels parse into reasoning_content, tool_calls and content,
whole and streamed alike; and end to end through the official `openai` client on a tiny random
gpt-oss checkpoint whose tokenizer has harmony's special tokens, its replies written by a logits
processor (kvserve.testing.logits_processors.ForceTokens) while the model runs."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.harmony import (
    StreamingHarmonyParser,
    parse_reply,
    speaks_harmony,
)
from tests.helpers import llama_cpp_chat_template, streamed_response

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
           "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
REASONING = "The user wants the weather. I should call get_weather."
ARGUMENTS = '{"city": "Paris", "unit": "c"}'
CALL_TURN = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             f"<|message|>{ARGUMENTS}<|call|>")
FINAL_TURN = ("<|channel|>analysis<|message|>It is 18 degrees.<|end|>"
              "<|start|>assistant<|channel|>final<|message|>It is 18 C in Paris.<|return|>")


@pytest.fixture(scope="module")
def template() -> str:
    return llama_cpp_chat_template("openai-gpt-oss-120b")


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, tokenizer, template):
    """SmolLM2's tokenizer with harmony's special tokens added and gpt-oss's template."""
    from tokenizers import Tokenizer as HFTokenizer

    directory = tmp_path_factory.mktemp("harmony")
    backend = HFTokenizer.from_str(tokenizer.backend.to_str())
    backend.add_special_tokens(SPECIAL)
    (directory / "tokenizer.json").write_text(backend.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"}))
    return directory


def _ours(directory):
    from kvserve.model_source import ModelSource
    from kvserve.tokenizer import load_tokenizer

    return load_tokenizer(ModelSource(name="harmony", path=directory, format="hf"))


CONVERSATIONS = [
    # (messages, template variables)
    ([{"role": "user", "content": "Hello!"}], {}),
    ([{"role": "system", "content": "Answer in French."},
      {"role": "user", "content": "What is the weather in Paris?"}],
     {"tools": [WEATHER], "reasoning_effort": "high"}),
    ([{"role": "user", "content": "What is the weather in Paris?"},
      {"role": "assistant", "thinking": REASONING, "tool_calls": [{
          "type": "function", "function": {"name": "get_weather",
                                           "arguments": {"city": "Paris", "unit": "c"}}}]},
      {"role": "tool", "content": "18 C"},
      {"role": "assistant", "content": "It is 18 C in Paris."},
      {"role": "user", "content": "And tomorrow?"}],
     {"tools": [WEATHER], "reasoning_effort": "low", "model_identity": "You are a helper."}),
]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_template_renders_as_hf_renders_it(harmony_dir, index, add_generation_prompt):
    """System and developer messages, tools as a TypeScript namespace, reasoning effort, a
    past call with its analysis and its result: the same text as transformers'
    apply_chat_template (the date is today's in both)."""
    messages, variables = CONVERSATIONS[index]
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(harmony_dir))
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **variables)
    ours = _ours(harmony_dir)
    got = ours.apply_chat_template(messages, add_generation_prompt, **variables)
    assert got == expected
    assert speaks_harmony(ours.chat_template)


def test_a_reasoning_and_call_turn_parses_into_its_fields():
    reply = parse_reply(CALL_TURN)
    assert reply.reasoning_content == REASONING and reply.content is None
    [call] = reply.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    final = parse_reply(FINAL_TURN)
    assert (final.reasoning_content, final.content, final.tool_calls) == \
        ("It is 18 degrees.", "It is 18 C in Paris.", [])


@pytest.mark.parametrize("text", [
    # the recipient before the channel, a preamble the user sees, no end marker (max_tokens)
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
    f"<|channel|>commentary json<|message|>{ARGUMENTS}<|call|>",
    CALL_TURN, FINAL_TURN, FINAL_TURN[:-len("<|return|>")], "<|channel|>analysis<|mess",
])
def test_streamed_deltas_rebuild_the_whole_parse(text, harmony_dir):
    """Fed the text token by token (special tokens whole, as the detokenizer gives them), the
    deltas put together are the whole parse's fields."""
    ours = _ours(harmony_dir)
    ids = ours.backend.encode(text, add_special_tokens=False).ids
    parser, deltas = StreamingHarmonyParser(), []
    for end in range(1, len(ids) + 1):
        deltas += parser.feed(ours.backend.decode(ids[:end], skip_special_tokens=False))
    fields = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call.get("function", {}).get("arguments", "")
        for name in fields:
            fields[name] += delta.get(name, "")
    whole = parse_reply(text)
    assert (fields["content"] or None, fields["reasoning_content"] or None) == \
        (whole.content, whole.reasoning_content)
    assert [calls[i] for i in sorted(calls)] == [call["function"] for call in whole.tool_calls]
    assert parser.called == bool(whole.tool_calls)


# ---- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def harmony_server(harmony_dir, tmp_path_factory):
    """A tiny random gpt-oss checkpoint (HF's own classes) with the harmony tokenizer, served
    with ForceTokens loaded and auto tool choice on."""
    from kvserve.testing.server import ServerProcess
    from tests.helpers import TINY_FAMILY_SHAPE

    directory = tmp_path_factory.mktemp("gpt_oss")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((harmony_dir / name).read_text())
    shape = dict(TINY_FAMILY_SHAPE, vocab_size=49152 + len(SPECIAL), head_dim=16,
                 num_hidden_layers=2)
    config = transformers.GptOssConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    flags = ["--model", str(directory), "--dtype", "float32", "--max-model-len", "512",
             "--served-model-name", "gpt-oss", "--enable-auto-tool-choice",
             "--logits-processors", "kvserve.testing.logits_processors:ForceTokens"]
    with ServerProcess(flags, log_path=tmp_path_factory.mktemp("log") / "server.log") as server:
        yield server, _ours(harmony_dir)


def _forced(tokenizer, text: str, **extra) -> dict:
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    return {"vllm_xargs": {"force_tokens": ids}, **extra}


def test_a_reasoning_and_tool_call_turn_through_the_openai_client(harmony_server):
    """The model's turn (analysis, then a call to functions.get_weather ending in <|call|>,
    where the server stops it): reasoning_content, one tool call, no content, finish reason
    tool_calls; streamed, the same fields."""
    server, tokenizer = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    request = dict(model="gpt-oss", tools=[WEATHER], max_tokens=200,
                   messages=[{"role": "user", "content": "Weather in Paris?"}],
                   extra_body=_forced(tokenizer, CALL_TURN + "never sent"))
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", json.loads(ARGUMENTS))
    reasoning, arguments, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for streamed in chunk.choices:
            delta = streamed.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            assert not delta.content
            for piece in delta.tool_calls or []:
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
            finish = streamed.finish_reason or finish
    assert (reasoning, names, arguments, finish) == \
        (REASONING, ["get_weather"], ARGUMENTS, "tool_calls")


def test_a_final_answer_after_a_tool_result(harmony_server):
    """The call and its result go back through the template; the next turn's analysis is
    reasoning_content and its final channel the content, ending at <|return|>."""
    server, tokenizer = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    choice = client.chat.completions.create(
        model="gpt-oss", tools=[WEATHER], messages=messages, max_tokens=200,
        reasoning_effort="low", extra_body=_forced(tokenizer, FINAL_TURN + "never sent")
    ).choices[0]
    assert (choice.message.model_extra["reasoning_content"], choice.message.content) == \
        ("It is 18 degrees.", "It is 18 C in Paris.")
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",  # gpt-oss's template needs one
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
TIME_CALL = ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
             '{"zone": "UTC"}<|call|>')
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_choices_allow_reasoning_then_a_call_only(harmony_dir, choice):
    """The grammar as xgrammar's matcher reads it over the harmony vocabulary: reasoning then a
    call, or a call alone (the channel or the recipient first), of an offered tool (or of the
    named one) with arguments its schema allows; no final answer, no call missing a required
    argument."""
    from kvserve.entrypoints.openai.tools.grammar import harmony_call_tag
    from kvserve.sampling_params import StructuredOutputsParams
    from kvserve.structured_output.backend import tokenizer_info, xgrammar
    from kvserve.structured_output.compiler import build_grammar

    xgr = xgrammar()
    ours = _ours(harmony_dir)
    info = tokenizer_info(ours, ours.backend.get_vocab_size(with_added_tokens=True))
    spec = StructuredOutputsParams(structural_tag=harmony_call_tag([WEATHER, TIME], choice))
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(spec))
    call_alone = CALL_TURN.split("<|start|>assistant", 1)[1]
    recipient_first = (" to=functions.get_weather<|channel|>commentary json<|message|>"
                       f"{ARGUMENTS}<|call|>")
    allowed = [CALL_TURN, call_alone, recipient_first] + ([TIME_CALL] if choice == "required"
                                                          else [])
    refused = [FINAL_TURN, call_alone.replace(ARGUMENTS, '{"unit": "c"}'),
               "<|channel|>final<|message|>Sunny.<|return|>"] + ([] if choice == "required"
                                                               else [TIME_CALL])
    for text in allowed:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text), text
        assert matcher.accept_token(ours.eos_token_id) and matcher.is_terminated(), text
    for text in refused:
        assert not xgr.GrammarMatcher(compiled).accept_string(text), text


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_choices_through_the_openai_client(harmony_server, choice):
    """The constrained turn, written by the model through the grammar: its call comes back as
    tool_calls with its reasoning."""
    server, tokenizer = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    choice_made = client.chat.completions.create(
        model="gpt-oss", tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body=_forced(tokenizer, CALL_TURN + "never sent")).choices[0]
    assert choice_made.finish_reason == "tool_calls"
    assert choice_made.message.model_extra["reasoning_content"] == REASONING
    [call] = choice_made.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", json.loads(ARGUMENTS))


def test_tool_choices_that_clash_with_other_constraints_are_400s(harmony_server):
    server, _ = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="tools and response_format"):
        client.chat.completions.create(
            model="gpt-oss", tools=[WEATHER], tool_choice="required", max_tokens=5,
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Weather?"}])
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(
            model="gpt-oss", tools=[WEATHER], tool_choice=NAMED, max_tokens=5,
            messages=[{"role": "user", "content": "Weather?"}], extra_body={"min_tokens": 2})


# ---- the Responses API ------------------------------------------------------------------------

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_items_whole_and_streamed_through_the_openai_client(harmony_server):
    """A reasoning + call turn as Responses items: a reasoning item (its text as reasoning
    text), then a function call; streamed, the reasoning_text deltas and the call's arguments
    rebuild the same, and the completed response holds the same items."""
    server, tokenizer = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    request = dict(model="gpt-oss", input="Weather in Paris?", tools=[FLAT_WEATHER],
                   max_output_tokens=200, reasoning={"effort": "low"},
                   extra_body=_forced(tokenizer, CALL_TURN + "never sent"))
    response = client.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert [part.text for part in reasoning.content] == [REASONING]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", json.loads(ARGUMENTS))
    deltas, completed = streamed_response(client, **request)
    assert (deltas["response.reasoning_text.delta"],
            deltas["response.function_call_arguments.delta"]) == (REASONING, ARGUMENTS)
    assert [item.type for item in completed.output] == ["reasoning", "function_call"]
    assert completed.output[0].content[0].text == REASONING


def test_responses_continue_after_a_call_with_its_reasoning(harmony_server):
    """The call's output sent with previous_response_id: the next turn (forced: analysis,
    then the final answer) is a reasoning item and a message, its text the output_text; the
    stored turn's reasoning went back into the prompt before its call (gpt-oss's template
    renders it as the call's analysis)."""
    server, tokenizer = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    first = client.responses.create(
        model="gpt-oss", input="Weather in Paris?", tools=[FLAT_WEATHER], max_output_tokens=200,
        extra_body=_forced(tokenizer, CALL_TURN + "never sent"))
    call = first.output[1]
    second = client.responses.create(
        model="gpt-oss", previous_response_id=first.id, tools=[FLAT_WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        max_output_tokens=200, extra_body=_forced(tokenizer, FINAL_TURN + "never sent"))
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output_text == "It is 18 C in Paris."
    without_reasoning = client.responses.create(
        model="gpt-oss", tools=[FLAT_WEATHER], max_output_tokens=200,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        extra_body=_forced(tokenizer, FINAL_TURN + "never sent"))
    reasoning_tokens = len(tokenizer.backend.encode(REASONING, add_special_tokens=False).ids)
    assert second.usage.input_tokens - without_reasoning.usage.input_tokens >= reasoning_tokens


@pytest.mark.parametrize("text", [
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
    f"<|channel|>commentary json<|message|>{ARGUMENTS}<|call|>",
    CALL_TURN, FINAL_TURN, FINAL_TURN[:-len("<|return|>")],
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
])
def test_streamed_responses_items_equal_the_whole_answers(text, harmony_dir):
    """Fed token by token, the Responses stream closes with the items the whole answer has
    (types, texts, names, arguments, statuses)."""
    from kvserve.entrypoints.openai.responses.objects import harmony_items
    from kvserve.entrypoints.openai.responses.stream import EventWriter, OutputStream

    ours = _ours(harmony_dir)
    ids = ours.backend.encode(text, add_special_tokens=False).ids
    stream = OutputStream(EventWriter(), harmony=True)
    for end in range(1, len(ids) + 1):
        stream.feed(ours.backend.decode(ids[:end], skip_special_tokens=False), end == len(ids))
    finish_reason = "stop" if text.endswith(("<|call|>", "<|return|>")) else "length"
    stream.finish(finish_reason)

    def comparable(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    status = "completed" if finish_reason == "stop" else "incomplete"
    assert comparable(stream.items) == comparable(harmony_items(text, status))


def test_reasoning_items_become_the_next_assistant_turns_reasoning(harmony_dir):
    from kvserve.entrypoints.openai.responses.conversation import chat_messages
    from kvserve.entrypoints.openai.responses.protocol import ResponsesRequest

    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": REASONING}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]})
    messages = chat_messages(None, request.input_items())
    assert messages[1]["reasoning_content"] == REASONING and messages[1]["tool_calls"]
    chat = request.chat_request(messages)
    rendered = _ours(harmony_dir).apply_chat_template(
        [m.as_template_message() for m in chat.messages], True, tools=[WEATHER])
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in rendered


def test_reasoning_summaries_are_400s(harmony_server):
    server, _ = harmony_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="reasoning.summary"):
        client.responses.create(model="gpt-oss", input="Hi", max_output_tokens=5,
                                reasoning={"effort": "low", "summary": "auto"})
