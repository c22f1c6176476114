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


def test_streamed_deltas_rebuild_the_whole_answer():
    """Fed a character at a time: content up to the first call (never a piece of the tag),
    then each call as an id-and-name delta and an arguments delta, in order."""
    parser = StreamingToolParser(HERMES)
    deltas = []
    for end in range(1, len(TWO_CALLS) + 1):
        deltas += parser.feed(TWO_CALLS[:end], end == len(TWO_CALLS))
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me check." and "<" not in content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert [c["function"].get("name") for c in calls[::2]] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert parser.called


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
    openai_client, _ = client
    whole = openai_client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in openai_client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
            temperature=0, parallel_tool_calls=False, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    expected = [(c.function.name, json.loads(c.function.arguments))
                for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
    assert len(expected) == 1 and finish == "tool_calls"


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
        agent = agents.Agent(name="helper", instructions="Use the tools to answer.",
                             tools=[get_weather, add], model=model,
                             model_settings=agents.ModelSettings(
                                 tool_choice="required", temperature=0, max_tokens=96))
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
    settings callable names get_weather on the first request and add on the second, then leaves
    the choice to the model ("auto") for the answer."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    _, server = client
    forced = {1: ["get_weather"], 2: ["add"]}
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
