"""Benchmark workloads with a fixed seed, prompts cut from real text (the Python standard
library's source), so prefix-cache and speculative behaviour stay realistic.

Prompts are token slices of that text decoded back to strings; a server re-tokenizing them may see
a token or two more or fewer, and the client reports what the server counted.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

_EDIT_INSTRUCTION = "Add type hints to this Python code. Change nothing else; answer with " \
    "the whole code."
_TOP_LEVEL_DEFINITION = re.compile(r"(def|class) ")
_CODE_FILE_TRIES = 100  # corpus slices tried for a stretch of code (a few are enough)
_SOURCE_MODULES = ("textwrap", "argparse", "json.decoder", "collections", "functools",
                   "dataclasses", "logging", "email.message")


# Structured output's benchmark constraint: an array of records too long to finish in 128
# tokens, so every output token is masked (with ignore_eos the grammar never ends first)
BENCH_JSON_SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "additionalProperties": False,
              "required": ["id", "name", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0},
                             "name": {"type": "string", "maxLength": 24},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 12}}}}}


def structured_body(server: str) -> dict:
    """The request fields that constrain a completion to BENCH_JSON_SCHEMA on this server:
    llama.cpp's server reads `json_schema`; kvserve and vLLM `structured_outputs`."""
    if server.startswith("llama.cpp"):
        return {"json_schema": BENCH_JSON_SCHEMA}
    return {"structured_outputs": {"json": BENCH_JSON_SCHEMA}}


@dataclass
class RequestSpec:
    prompt: str
    prompt_tokens: int
    output_len: int


@dataclass
class Session:
    """Multi-turn: each turn's prompt is the system prompt (shared by every session), the
    conversation so far and the next user turn, in a plain "User:/Assistant:" frame, or with
    `render` (messages -> the chat template's text up to the answer) in the model's chat
    template; every answer begins with `answer_start`, sent as the prompt's end."""

    user_turns: list[str]
    output_len: int
    system_prompt: str = ""
    render: Callable[[list[dict]], str] | None = None
    answer_start: str = ""


def corpus_tokens(tokenizer) -> list[int]:
    import importlib

    text = "\n\n".join(inspect.getsource(importlib.import_module(name))
                       for name in _SOURCE_MODULES)
    return tokenizer.encode(text, add_special_tokens=False)


class TextSource:
    """Hands out consecutive-or-random slices of the corpus as text of a given token length."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.tokens = corpus_tokens(tokenizer)
        self.rng = random.Random(seed)

    def take(self, length: int) -> str:
        length = max(1, length)
        if length >= len(self.tokens):
            repeats = length // len(self.tokens) + 1
            pool = self.tokens * repeats
            return self.tokenizer.decode(pool[:length], False)
        start = self.rng.randrange(0, len(self.tokens) - length)
        return self.tokenizer.decode(self.tokens[start:start + length], False)


def _spread(rng: random.Random, center: int, range_ratio: float) -> int:
    if range_ratio <= 0:
        return center
    low = max(1, int(center * (1 - range_ratio)))
    high = max(low, int(center * (1 + range_ratio)))
    return rng.randint(low, high)


def random_workload(source: TextSource, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0) -> list[RequestSpec]:
    specs = []
    for _ in range(num_prompts):
        length = _spread(source.rng, input_len, range_ratio)
        specs.append(RequestSpec(source.take(length), length,
                                 _spread(source.rng, output_len, range_ratio)))
    return specs


def code_edit_workload(source: TextSource, num_prompts: int, input_len: int,
                       output_len: int) -> list[RequestSpec]:
    """A code edit: a stretch of a source file (at least `input_len` tokens of whole lines
    from a top-level definition on) and an instruction that changes little (add type hints),
    in the model's chat template where it has one, with the answer's code fence opened. A
    good answer repeats most of its input, the case speculative decoding from the context
    serves (favourable to it by design, so read it beside the random scenarios).

    Two earlier versions measured something else. The first asked a bare completion to "copy"
    a snippet cut mid-line; SmolLM2 fell into loops, which drafts matched for the wrong reason.
    The second pasted one definition, often a method of three lines, so a 128-token answer
    ran past the code's end into text nothing in the prompt could draft."""
    specs = []
    for _ in range(num_prompts):
        code = _code_file(source, input_len)
        prompt = _as_chat(source.tokenizer, f"{_EDIT_INSTRUCTION}\n\n```python\n{code}\n```",
                          answer_start="```python\n")
        specs.append(RequestSpec(prompt, len(source.tokenizer.encode(
            prompt, add_special_tokens=False)), output_len))
    return specs


def _code_file(source: TextSource, min_tokens: int) -> str:
    """Whole lines of the corpus from a top-level `def` or `class` on, up to the first blank
    line after `min_tokens` tokens: code as a user would paste it into an edit request, long
    enough that an answer of about that many tokens is still repeating it."""
    for _ in range(_CODE_FILE_TRIES):
        lines = source.take(4 * min_tokens).split("\n")[1:-1]  # the ends are cut mid-line
        first = next((i for i, line in enumerate(lines)
                      if _TOP_LEVEL_DEFINITION.match(line)), None)
        if first is None:
            continue
        code: list[str] = []
        for line in lines[first:]:
            if not line.strip() and code and _token_count(source, code) >= min_tokens:
                return "\n".join(code)
            code.append(line)
    raise ValueError(f"no {min_tokens}-token stretch of code from a top-level definition in "
                     f"{_CODE_FILE_TRIES} slices of the corpus")


def _token_count(source: TextSource, lines: list[str]) -> int:
    return len(source.tokenizer.encode("\n".join(lines), add_special_tokens=False))


def _as_chat(tokenizer, user_message: str, answer_start: str) -> str:
    """One user turn in the tokenizer's chat template, as the text a completions request
    sends (every server under test tokenizes its special tokens), and the answer's start; a
    plain "User:/Assistant:" frame where the model has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return f"User: {user_message}\nAssistant: {answer_start}"
    return _render_chat(tokenizer, [{"role": "user", "content": user_message}]) + answer_start


def _render_chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def agentic_workload(source: TextSource, num_sessions: int, turns: int, user_len: int,
                     output_len: int) -> list[Session]:
    """An agent editing code: every turn brings a tool's output (a file read) and asks for the
    file with type hints added; the session's tool returns one of two files, so later turns
    re-read what earlier ones showed and the answers repeat both the file and earlier answers
    (speculative decoding's second case: drafts from the context and earlier turns). In the
    model's chat template with the answer's code fence opened, as the edit workload; an
    earlier version asked a bare "User:/Assistant:" frame to quote cut-off text, and SmolLM2
    answered with loops instead."""
    render = (partial(_render_chat, source.tokenizer)
              if getattr(source.tokenizer, "chat_template", None) is not None else None)
    sessions = []
    for _ in range(num_sessions):
        files = [_code_file(source, user_len) for _ in range(2)]
        sessions.append(Session([f"`read_file` returned:\n\n```python\n{files[turn % 2]}\n```"
                                 f"\n\n{_EDIT_INSTRUCTION}" for turn in range(turns)],
                                output_len, render=render, answer_start="```python\n"))
    return sessions


def shared_prefix_workload(source: TextSource, num_prompts: int, prefix_len: int,
                           input_len: int, output_len: int) -> list[RequestSpec]:
    """One long shared system prompt, then a unique part per request (agents, RAG)."""
    prefix = source.take(prefix_len)
    return [RequestSpec(prefix + "\n" + source.take(input_len), prefix_len + input_len + 1,
                        output_len) for _ in range(num_prompts)]


def long_prompt_workload(source: TextSource, num_prompts: int, input_len: int, output_len: int,
                         long_len: int, long_every: int = 8) -> list[RequestSpec]:
    """Short chats with a very long prompt every `long_every` requests (prefill interference)."""
    specs = []
    for index in range(num_prompts):
        length = long_len if index % long_every == long_every - 1 else input_len
        specs.append(RequestSpec(source.take(length), length, output_len))
    return specs


def multi_turn_workload(source: TextSource, num_sessions: int, turns: int, user_len: int,
                        output_len: int, system_prompt_len: int = 0) -> list[Session]:
    """Sessions of `turns` user turns; with `system_prompt_len`, one system prompt of that
    many tokens opens every session (a shared prefix, then each session's own growing
    history: what a KV-aware router places by)."""
    system = source.take(system_prompt_len) + "\n" if system_prompt_len else ""
    return [Session([source.take(user_len) for _ in range(turns)], output_len, system)
            for _ in range(num_sessions)]


def agent_sessions_workload(source: TextSource, num_sessions: int, turns: int, user_len: int,
                            output_len: int, system_prompt_len: int = 0) -> list[Session]:
    """Many agent sessions whose contexts grow turn by turn (a tool's output each turn), each
    revisited only after all the others (bench client's `run_sessions_interleaved`): the
    working set of all sessions' contexts is far larger than the KV pool, so a turn finds its
    own history evicted unless a KV offload tier kept it (issue 34)."""
    return multi_turn_workload(source, num_sessions, turns, user_len, output_len,
                               system_prompt_len)
