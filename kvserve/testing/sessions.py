"""Interleaved multi-turn sessions through a router, and the share of their reusable context
that came back cached (tests/test_router.py's must-show, benchmarks/router_defaults.py's
real-model run)."""

from __future__ import annotations

import time

import httpx


def interleaved_sessions(base_url: str, sessions: int = 6, turns: int = 4,
                         think_seconds: float = 0.0, block_size: int = 16,
                         max_tokens: int = 12) -> float:
    """Sessions of `turns` turns, asked round by round (every session's turn t before any
    turn t+1, `think_seconds` between rounds); the share of reusable prompt tokens (each
    turn's whole earlier context, in full blocks) that came back cached."""
    histories = [f"Session {s} of the agent. " + " ".join(f"fact{s}-{i}" for i in range(30))
                 for s in range(sessions)]
    context = [0] * sessions  # tokens of the previous turn's prompt and answer
    cached = reusable = 0
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for turn in range(turns):
            for s in range(sessions):
                histories[s] += f"\nUser: tell me about step {turn}.\nAssistant:"
                response = client.post("/v1/completions", json={
                    "prompt": histories[s], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True})
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text}")
                answer = response.json()
                usage = answer["usage"]
                if turn:
                    can_reuse = (context[s] - 1) // block_size * block_size
                    reusable += can_reuse
                    cached += min(usage["prompt_tokens_details"]["cached_tokens"], can_reuse)
                context[s] = usage["prompt_tokens"] + usage["completion_tokens"]
                histories[s] += answer["choices"][0]["text"]
            time.sleep(think_seconds)
    return cached / reusable
