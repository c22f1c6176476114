"""Load and disconnect drivers for the reliability suites: many concurrent streaming clients
that check every token arrived, and clients that walk away at chosen points.

Everything talks real HTTP to a server on loopback; nothing here knows the engine.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import httpx

_WORDS = ("river stone lantern quiet harbor copper meadow signal orbit velvet ember canyon "
          "thistle marble compass willow falcon prism cedar tundra").split()


@dataclass(frozen=True)
class LoadRequest:
    """One request of a mixed workload: ignore_eos, so exactly n * max_tokens tokens come."""

    kind: str  # "chat" | "completion"
    prompt: str
    n: int
    max_tokens: int
    logprobs: bool  # ask for per-token logprobs, which lets the client count tokens per choice
    temperature: float = 0.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def payload(self) -> dict:
        body: dict = {"n": self.n, "max_tokens": self.max_tokens, "ignore_eos": True,
                      "temperature": self.temperature, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.logprobs:
                body["logprobs"] = True
        else:
            body["prompt"] = self.prompt
            if self.logprobs:
                body["logprobs"] = 0
        return body


def prose(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def mixed_workload(count: int, seed: int = 0, long_words: tuple[int, int] = (150, 600),
                   max_tokens: tuple[int, int] = (4, 16)) -> list[LoadRequest]:
    """Short and long prompts (a quarter long, half of those behind a shared prefix), chat and
    completions, n = 1..3, some sampled and some with logprobs (both cost a lot per token over
    a 49k vocabulary on the CPU, so most requests are greedy without them)."""
    rng = random.Random(seed)
    shared = prose(random.Random(seed + 1), long_words[0])
    requests = []
    for i in range(count):
        if rng.random() < 0.25:
            body = prose(rng, rng.randint(*long_words))
            prompt = f"{shared} {body}" if rng.random() < 0.5 else body
        else:
            prompt = f"Request {i}: {prose(rng, rng.randint(2, 12))}"
        requests.append(LoadRequest(kind=rng.choice(("chat", "completion")), prompt=prompt,
                                    n=rng.randint(1, 3), max_tokens=rng.randint(*max_tokens),
                                    logprobs=rng.random() < 0.15,
                                    temperature=0.8 if rng.random() < 0.15 else 0.0))
    return requests


@dataclass
class StreamResult:
    request: LoadRequest
    status: int = 0
    completion_tokens: int | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    tokens_per_choice: dict[int, int] = field(default_factory=dict)
    done: bool = False
    error: str | None = None

    def problems(self) -> list[str]:
        """Why this request did not complete with exactly the right tokens (empty if it did)."""
        request, found = self.request, []
        if self.error or self.status != 200:
            return [f"status {self.status}, error {self.error}"]
        if not self.done:
            found.append("no [DONE]")
        if self.completion_tokens != request.n * request.max_tokens:
            found.append(f"usage {self.completion_tokens} != {request.n} x {request.max_tokens}")
        if self.finish_reasons != {i: "length" for i in range(request.n)}:
            found.append(f"finish reasons {self.finish_reasons}")
        if request.logprobs and self.tokens_per_choice != {
                i: request.max_tokens for i in range(request.n)}:
            found.append(f"tokens per choice {self.tokens_per_choice}")
        return found


def _logprob_tokens(choice: dict) -> int:
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return len(logprobs["content"] or [])
    return len(logprobs.get("tokens") or [])


def _consume_event(data: str, result: StreamResult) -> None:
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error = event["error"].get("message", "error event")
        return
    if event.get("usage"):
        result.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event.get("choices", []):
        index = choice["index"]
        result.tokens_per_choice[index] = (result.tokens_per_choice.get(index, 0)
                                           + _logprob_tokens(choice))
        if choice.get("finish_reason"):
            result.finish_reasons[index] = choice["finish_reason"]


async def stream_one(client: httpx.AsyncClient, request: LoadRequest) -> StreamResult:
    """Send one streaming request and read it to the end; never raises."""
    result = StreamResult(request)
    try:
        async with client.stream("POST", request.path, json=request.payload()) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    _consume_event(line[6:], result)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(base_url: str, requests: list[LoadRequest], concurrency: int,
                   headers: dict | None = None) -> list[StreamResult]:
    """All `requests`, at most `concurrency` in flight, each on its own connection."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits,
                                 headers=headers) as client:
        async def gated(request: LoadRequest) -> StreamResult:
            async with gate:
                return await stream_one(client, request)

        return await asyncio.gather(*(gated(r) for r in requests))


# ---- clients that leave --------------------------------------------------------------------
DISCONNECT_MODES = ("partial_request", "before_first_byte", "mid_prefill", "mid_stream",
                    "non_stream_wait")


@dataclass(frozen=True)
class Disconnect:
    mode: str
    body: dict
    path: str
    delay: float = 0.0  # seconds between sending and leaving (mid_prefill, non_stream_wait)
    events: int = 0  # SSE events to read before leaving (mid_stream)
    reset: bool = False  # leave with a TCP reset instead of a FIN


def disconnect_plan(count: int, seed: int = 0, long_words: int = 900) -> list[Disconnect]:
    """`count` clients cycling through the disconnect modes, with random delays and prompts
    long enough that leaving early always leaves work unfinished."""
    rng = random.Random(seed)
    plan = []
    for i in range(count):
        mode = DISCONNECT_MODES[i % len(DISCONNECT_MODES)]
        chat = rng.random() < 0.5
        prompt = (prose(rng, long_words) if mode == "mid_prefill"
                  else f"Client {i}: {prose(rng, 8)}")
        stream = {"mid_stream": True, "non_stream_wait": False}.get(mode, rng.random() < 0.7)
        body: dict = {"max_tokens": 400, "ignore_eos": True, "n": rng.randint(1, 2),
                      "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        plan.append(Disconnect(mode, body, "/v1/chat/completions" if chat else "/v1/completions",
                               delay=rng.uniform(0.0, 0.3), events=rng.randint(1, 6),
                               reset=rng.random() < 0.3))
    return plan


def _raw_request(path: str, body: bytes, port: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def disconnect_once(port: int, plan: Disconnect) -> bool:
    """Run one leaving client over a raw socket; True if it left before its response ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(plan.body).encode()
    left_early = True
    try:
        if plan.mode == "partial_request":
            writer.write(_raw_request(plan.path, body, port)[:-len(body) // 2])
            await writer.drain()
        else:
            writer.write(_raw_request(plan.path, body, port))
            await writer.drain()
            if plan.mode in ("mid_prefill", "non_stream_wait"):
                await asyncio.sleep(plan.delay)
            elif plan.mode == "mid_stream":
                left_early = await _read_events(reader, plan.events)
    finally:
        if plan.reset:
            writer.transport.abort()
        else:
            writer.close()
    return left_early


async def _read_events(reader: asyncio.StreamReader, count: int) -> bool:
    """Read until `count` SSE data lines arrived; False if the response ended first."""
    seen = 0
    while seen < count:
        line = await reader.readline()
        if not line:
            return False
        if line.startswith(b"data: [DONE]"):
            return False
        seen += line.startswith(b"data: ")
    return True


async def run_disconnects(port: int, plan: list[Disconnect], concurrency: int) -> list[bool]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(item: Disconnect) -> bool:
        async with gate:
            return await disconnect_once(port, item)

    return await asyncio.gather(*(gated(item) for item in plan))
