"""Tool calling: the parsers (whole and streamed, both formats), the default tool prompt, the
grammar each tool_choice asks for, and end to end on the real model through the official
`openai` client: `required` and named choices always give calls that parse and match their
parameters' schema, streamed as OpenAI streams them, and tool results go back in the history."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvserve.entrypoints.openai.tools.formats import HERMES, LLAMA3_JSON, choose_format
from kvserve.entrypoints.openai.tools.grammar import tool_structural_tag
from kvserve.entrypoints.openai.tools.parser import StreamingToolParser, parse_tool_calls
from kvserve.entrypoints.openai.tools.prompt import template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 1000},
        "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
             '"b": 2}}\n</tool_call>')


# ---- parsing --------------------------------------------------------------------------------
def test_hermes_calls_parse_with_the_text_around_them():
    parsed = parse_tool_calls(TWO_CALLS, HERMES)
    assert parsed.content.strip() == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                       ("add", {"a": 1, "b": 2})]
    assert len({c["id"] for c in parsed.calls}) == 2
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "add", "argu', "<tool_call>not json"
                                  "</tool_call>", '<tool_call>{"name": 3}</tool_call>'])
def test_an_unfinished_or_malformed_call_stays_text(text):
    parsed = parse_tool_calls(text, HERMES)
    assert parsed.calls == [] and parsed.content == text


def test_llama3_json_calls():
    parsed = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', LLAMA3_JSON)
    assert parsed.content == "" and json.loads(parsed.calls[0]["function"]["arguments"]) == {
        "a": 1, "b": 2}


def _fed_by_character(text: str, tool_format
                      ) -> tuple[StreamingToolParser, list[tuple[int, dict]]]:
    """The parser fed `text` a character at a time, and its deltas, each with the length of
    the text it came at."""
    parser = StreamingToolParser(tool_format)
    deltas = []
    for end in range(1, len(text) + 1):
        deltas += [(end, d) for d in parser.feed(text[:end], end == len(text))]
    return parser, deltas


def _streamed_calls(deltas: list[tuple[int, dict]]) -> list[dict]:
    """The calls the client puts together from the tool_calls deltas, by index, as OpenAI's
    client does: the id, type and name from the first, the arguments concatenated."""
    calls: dict[int, dict] = {}
    for _, delta in deltas:
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in calls:  # the first: id, type and name
                calls[piece["index"]] = {"id": piece["id"], "type": piece["type"], "function": {
                    "name": piece["function"]["name"], "arguments": ""}}
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                    "arguments"}
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return list(calls.values())


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]


def test_streamed_deltas_rebuild_the_whole_answer():
    """Fed a character at a time: content up to the first call (never a piece of the tag),
    then each call, in order, as an id-and-name delta and its arguments."""
    parser, deltas = _fed_by_character(TWO_CALLS, HERMES)
    content = "".join(d.get("content", "") for _, d in deltas)
    assert content.strip() == "Let me check." and "<" not in content
    calls = _streamed_calls(deltas)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert parser.called and parser.calls_done == 2


@pytest.mark.parametrize("text,tool_format", [
    (TWO_CALLS, HERMES),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "add", "parameters": {"a": 1, "b": 2}}', LLAMA3_JSON)])
def test_arguments_stream_in_pieces_as_they_are_written(text, tool_format):
    """As OpenAI sends them: a call's id and name as soon as its header is written (before its
    arguments are), then its arguments in several pieces, adding up to exactly the arguments
    the whole parse gives."""
    _, deltas = _fed_by_character(text, tool_format)
    whole = parse_tool_calls(text, tool_format).calls
    assert _without_ids(_streamed_calls(deltas)) == _without_ids(whole) and len(whole) == 2
    for index, call in enumerate(whole):
        arguments = call["function"]["arguments"]
        pieces = [(at, d["tool_calls"][0]) for at, d in deltas
                  if "tool_calls" in d and d["tool_calls"][0]["index"] == index]
        named_at, first = pieces[0]
        assert "id" in first and first["function"] == {"name": call["function"]["name"],
                                                       "arguments": ""}
        assert named_at == text.index(arguments) + 1  # the moment the `{` is written
        assert len(pieces[1:]) > 3 and all("id" not in p for _, p in pieces[1:])


def test_arguments_with_nesting_and_quoted_braces_stream_exactly():
    """Braces, brackets and quotes inside strings (escaped quotes too) do not end the
    arguments early, nesting does not end them late, and any whitespace in the header will
    do."""
    arguments = ('{"q": "a } b { c", "say": "he said \\"hi}\\" ]", "path": "C:\\\\",'
                 ' "n": [1, [2, {"x": {}}], "]"], "o": {"k": {"l": [{}]}}}')
    text = f'<tool_call>\n{{ "name" :\n"search",\t"arguments":  {arguments} }}\n</tool_call>'
    _, deltas = _fed_by_character(text, HERMES)
    whole = parse_tool_calls(text, HERMES).calls
    assert whole[0]["function"]["arguments"] == arguments
    assert _without_ids(_streamed_calls(deltas)) == _without_ids(whole)
    assert json.loads(arguments)["say"] == 'he said "hi}" ]'


def test_a_call_laid_out_otherwise_goes_out_whole_once_parsed():
    """The name after the arguments, or arguments as a JSON string: no streamable header, so
    the call goes out as two deltas once it has parsed, as the whole parse gives it."""
    text = ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>')
    _, deltas = _fed_by_character(text, HERMES)
    whole = parse_tool_calls(text, HERMES).calls
    assert [c["function"]["arguments"] for c in whole] == ['{"a": 1}', '{"a": 2}']
    assert _without_ids(_streamed_calls(deltas)) == _without_ids(whole)
    assert len([d for _, d in deltas if "tool_calls" in d]) == 4


def test_a_call_cut_off_mid_arguments_keeps_what_was_sent():
    """max_tokens mid-call: the id, name and arguments so far went out (as OpenAI and vLLM
    leave them); nothing more comes, and the whole parse keeps the unfinished call as text."""
    text = TWO_CALLS[:TWO_CALLS.index('"unit"') + 3]
    parser, deltas = _fed_by_character(text, HERMES)
    calls = _streamed_calls(deltas)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "un'
    assert len([d for _, d in deltas if "tool_calls" in d]) > 3
    assert parser.feed(text, True) == [] and parser.called and parser.calls_done == 0
    assert parse_tool_calls(text, HERMES).calls == []


def test_plain_text_streams_whole_when_no_call_comes():
    parser = StreamingToolParser(HERMES)
    text = "No tools needed <tool"
    deltas = parser.feed(text, False) + parser.feed(text, True)
    assert "".join(d["content"] for d in deltas) == text and not parser.called


# ---- prompting and grammars -------------------------------------------------------------
def test_default_prompt_lists_tools_and_turns_results_into_user_turns():
    """A template without tools: the tools go into the system message (after the caller's),
    earlier calls back into <tool_call> blocks, results into one user turn of
    <tool_response> blocks (templates such as Gemma's take only alternating turns)."""
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris and 1+2?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "a", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "a", "content": "3"},
               {"role": "tool", "tool_call_id": "b", "content": "18 C"}]
    messages, extra = template_messages(history, TOOLS, HERMES, template_takes_tools=False)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.") and '"get_weather"' in \
        messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "add", "arguments": {"a": 1, '
                                      '"b": 2}}\n</tool_call>')
    assert messages[3]["content"] == ("<tool_response>\n3\n</tool_response>\n"
                                      "<tool_response>\n18 C\n</tool_response>")


def test_a_template_with_tools_gets_them_and_argument_mappings():
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}]
    messages, extra = template_messages(history, TOOLS, HERMES, template_takes_tools=True)
    assert extra == {"tools": TOOLS}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_format_follows_the_template_unless_named():
    assert choose_format("auto", None) is HERMES
    assert choose_format("auto", "{{ tools }} <tool_call>") is HERMES
    assert choose_format("auto", "{{ tools }} <|python_tag|> parameters") is LLAMA3_JSON
    assert choose_format("llama3_json", None) is LLAMA3_JSON


def test_required_allows_only_calls_and_a_named_choice_one_call():
    required = json.loads(tool_structural_tag(TOOLS, "required", False, HERMES))["format"]
    assert required["type"] == "or" and len(required["elements"]) == 2
    parallel = json.loads(tool_structural_tag(TOOLS, "required", True, HERMES))["format"]
    assert parallel["type"] == "tags_with_separator" and parallel["at_least_one"]
    named = json.loads(tool_structural_tag(
        TOOLS, {"type": "function", "function": {"name": "add"}}, True, HERMES))["format"]
    assert named["type"] == "tag" and '"add"' in named["begin"]
    auto = json.loads(tool_structural_tag(TOOLS, "auto", True, HERMES))["format"]
    assert auto["type"] == "triggered_tags" and not auto["at_least_one"]


# ---- end to end on the real model ---------------------------------------------------------
openai = pytest.importorskip("openai")
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused"), smol_server


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_choices_always_give_valid_calls(client, temperature):
    openai_client, _ = client
    for choice in ["required", {"type": "function", "function": {"name": "add"}}]:
        response = openai_client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96,
            temperature=temperature, n=2, seed=3)
        for answer in response.choices:
            calls = _valid_calls(answer.message)
            assert calls and answer.finish_reason == "tool_calls", answer
            if choice != "required":
                assert {name for name, _ in calls} == {"add"}


@pytest.mark.slow
def test_streamed_calls_equal_the_whole_answer(client):
    """The same call streamed and whole: its name, its arguments' exact text (streamed in
    pieces as they are written) and every token's logprobs."""
    openai_client, _ = client
    ask = dict(model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
               temperature=0, parallel_tool_calls=False, logprobs=True, top_logprobs=2)
    whole = openai_client.chat.completions.create(**ask)
    calls: dict[int, dict] = {}
    finish, argument_pieces, logprobs = None, 0, []
    for chunk in openai_client.chat.completions.create(**ask, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.logprobs is not None:
            logprobs += choice.logprobs.content or []
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
            argument_pieces += bool(delta.function.arguments)
    expected = [(c.function.name, c.function.arguments)
                for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert len(expected) == 1 and finish == "tool_calls" and argument_pieces > 1
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in logprobs] == \
        [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs])
         for lp in whole.choices[0].logprobs.content]
    assert len(logprobs) == whole.usage.completion_tokens


@pytest.mark.slow
def test_a_tool_result_goes_back_into_the_conversation(client):
    """The agent loop's second turn: the assistant's call and the tool's result in the history
    are accepted and rendered; the model answers (text or another valid call)."""
    openai_client, _ = client
    first = openai_client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0, parallel_tool_calls=False)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = openai_client.chat.completions.create(
        model="smol", messages=history, tools=TOOLS, max_tokens=48, temperature=0)
    answer = second.choices[0]
    assert answer.message.content or _valid_calls(answer.message)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tool_choice": "required", "min_tokens": 4}, "min_tokens"),
])
def test_tool_requests_that_cannot_be_served_are_400s(client, fields, param):
    _, server = client
    body = {"model": "smol", "messages": ASK, "tools": TOOLS, "max_tokens": 8, **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.json()


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_loop_with_two_tools_runs_to_completion(client, api):
    """The `openai-agents` SDK over /v1/responses (its default) and over chat completions: the
    first turn must call a tool (tool_choice "required"; the SDK then resets it to auto), the
    tools run, their results go back, and the loop ends with a final answer."""
    import asyncio

    import agents
    _, server = client
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append("get_weather")
        return f"18 C and sunny in {city}"

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append("add")
        return a + b

    async def run():
        model_class = (agents.OpenAIResponsesModel if api == "responses"
                       else agents.OpenAIChatCompletionsModel)
        model = model_class(model="smol", openai_client=openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused"))
        # max_tokens leaves room for SmolLM2's closing answer, whose length moves with the
        # prefill's numerics (at 96 the Responses variant ended "incomplete" once long
        # prompts took the integer kernel's int8 activations)
        agent = agents.Agent(name="helper", instructions="Use the tools to answer.",
                             tools=[get_weather, add], model=model,
                             model_settings=agents.ModelSettings(
                                 tool_choice="required", temperature=0, max_tokens=192))
        return await agents.Runner.run(agent, "What is the weather in Paris, and what is "
                                       "2 + 3?", max_turns=6)

    result = asyncio.run(run())
    kinds = [type(item).__name__ for item in result.new_items]
    assert calls and kinds.count("ToolCallItem") == kinds.count("ToolCallOutputItem") >= 1
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str)


@pytest.mark.slow
def test_a_pydantic_ai_loop_with_two_tools_runs_to_completion(client):
    """pydantic-ai's `Agent` over chat completions (`OpenAIChatModel` on an OpenAI-compatible
    provider): both tools run, their results go back, and the loop ends with a text answer.
    pydantic-ai refuses a static tool_choice "required" (the run could never end), so a per-step
    settings callable names get_weather on the first request and add on the second, then asks
    for the answer with "none" (given "auto", what SmolLM2 does after two results depends on the
    CPU's float sums: on Zen 5 it calls a tool again)."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    _, server = client
    forced = {1: ["get_weather"], 2: ["add"], 3: "none"}
    model = OpenAIChatModel("smol", provider=OpenAICompatibleProvider(
        "kvserve", base_url=server.base_url + "/v1", api_key="unused"))
    agent = Agent(model, instructions="Use the tools to answer.",
                  model_settings=lambda ctx: ModelSettings(
                      tool_choice=forced.get(ctx.run_step, "auto"), temperature=0,
                      max_tokens=96, parallel_tool_calls=False))
    calls = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append("get_weather")
        return f"18 C and sunny in {city}"

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append("add")
        return a + b

    result = agent.run_sync("What is the weather in Paris, and what is 2 + 3?",
                            usage_limits=UsageLimits(request_limit=6))
    parts = [part for message in result.all_messages() for part in message.parts]
    called = [part.tool_name for part in parts if isinstance(part, ToolCallPart)]
    returned = [part.tool_name for part in parts if isinstance(part, ToolReturnPart)]
    assert calls[:2] == called[:2] == returned[:2] == ["get_weather", "add"], (calls, parts)
    last = result.all_messages()[-1]
    assert isinstance(last, ModelResponse) and not last.tool_calls, last
    assert isinstance(result.output, str) and result.output.strip(), last
    assert any(isinstance(part, TextPart) for part in last.parts)
