"""Benchmark workloads with a fixed seed, prompts cut from real text (the Python standard
library's source), so prefix-cache and speculative behaviour stay realistic.

Prompts are token slices of that text decoded back to strings; a server re-tokenizing them may see
a token or two more or fewer, and the client reports what the server counted.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

_SOURCE_MODULES = ("textwrap", "argparse", "json.decoder", "collections", "functools",
                   "dataclasses", "logging", "email.message")


@dataclass
class RequestSpec:
    prompt: str
    prompt_tokens: int
    output_len: int


@dataclass
class Session:
    """Multi-turn: each turn's prompt is the system prompt (shared by every session), the
    conversation so far and the next user turn."""

    user_turns: list[str]
    output_len: int
    system_prompt: str = ""


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
    """Code to copy: a snippet of the corpus, a line asking for it again, and its start
    (what code editing, summaries that quote and agents re-reading tool output look like to a
    model: its output repeats its input, the case speculative decoding from the context
    serves; favourable to it by design, so read it beside the random scenarios)."""
    specs = []
    for _ in range(num_prompts):
        snippet = source.take(input_len)
        cue = snippet[:48]  # the copy's start, so the model continues it
        prompt = f"{snippet}\n\n# The code above, copied exactly:\n{cue}"
        specs.append(RequestSpec(prompt, input_len + 24, output_len))
    return specs


def agentic_workload(source: TextSource, num_sessions: int, turns: int, user_len: int,
                     output_len: int) -> list[Session]:
    """An agent's loop: every turn brings a tool's output (a file read, a command's result)
    and asks the model to quote what matters before acting; the session's tools return one
    of two outputs, so later turns re-read what earlier ones showed, and the answers quote
    both (speculative decoding's second case: drafts from the context and earlier turns)."""
    sessions = []
    for _ in range(num_sessions):
        outputs = [source.take(user_len), source.take(user_len)]
        sessions.append(Session([f"Tool output:\n{outputs[turn % 2]}\n\nQuote the tool "
                                 f"output above line by line, then say what to do next."
                                 for turn in range(turns)], output_len))
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
