"""An async client for any OpenAI-compatible server: streaming /v1/completions requests under a
concurrency limit or a Poisson arrival rate, timing every chunk. Greedy by default; temperature and
top_p go in the body as OpenAI's API has them, which kvserve, llama.cpp's server and vLLM accept."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from tqdm import tqdm

from kvserve.bench.stats import RequestResult
from kvserve.bench.workloads import RequestSpec, Session


class BenchClient:
    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 600.0, temperature: float = 0.0, top_p: float | None = None,
                 extra_body: dict | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.temperature = temperature
        self.top_p = top_p  # None: not sent (the server's default, 1.0)
        self.extra_body = extra_body or {}  # merged into every body (vLLM's --extra-body)
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                      timeout=timeout,
                                      limits=httpx.Limits(max_connections=1024,
                                                          max_keepalive_connections=1024))
        self.start = time.perf_counter()

    async def close(self) -> None:
        await self.http.aclose()

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def complete(self, prompt: str, max_tokens: int) -> RequestResult:
        """One streaming completion with ignore_eos; never raises. A request whose
        pooled connection the server had already closed (no response at all) is sent once more
        on a fresh connection, timed from the resend."""
        result = await self._complete_once(prompt, max_tokens)
        if result.error and "RemoteProtocolError" in result.error and not result.chunk_times:
            result = await self._complete_once(prompt, max_tokens)
        return result

    async def _complete_once(self, prompt: str, max_tokens: int) -> RequestResult:
        result = RequestResult(sent=self.now())
        chunks = 0
        try:
            async with self.http.stream("POST", "/v1/completions",
                                        json=self.request_body(prompt, max_tokens)) as response:
                if response.status_code != 200:
                    body = await response.aread()
                    result.error = f"HTTP {response.status_code}: {body[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    chunks += self._consume(line, result)
        except (httpx.HTTPError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.finished = self.now()
        if not result.output_tokens:
            result.output_tokens = chunks
        return result

    def request_body(self, prompt: str, max_tokens: int) -> dict:
        """The /v1/completions body: streamed with usage, ignore_eos so every request generates
        max_tokens, and the client's sampling settings."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": self.temperature, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if self.top_p is not None:
            body["top_p"] = self.top_p
        return {**body, **self.extra_body}

    def _consume(self, line: str, result: RequestResult) -> int:
        """Parse one SSE line; returns 1 if it carried generated text."""
        if not line.startswith("data:"):
            return 0
        data = line[5:].strip()
        if data == "[DONE]":
            return 0
        payload = json.loads(data)
        usage = payload.get("usage")
        if usage:
            result.output_tokens = usage.get("completion_tokens") or result.output_tokens
            result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens") or 0
        text = "".join(choice.get("text") or "" for choice in payload.get("choices") or [])
        if not text:
            return 0
        now = self.now()
        if result.first_token is None:
            result.first_token = now
        result.chunk_times.append(now)
        result.output_text += text
        return 1


async def run_requests(client: BenchClient, specs: list[RequestSpec], max_concurrency: int | None,
                       request_rate: float | None, seed: int, progress: bool = True
                       ) -> list[RequestResult]:
    """Send every spec; at most max_concurrency in flight; Poisson arrivals if request_rate."""
    limit = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    rng = random.Random(seed)
    bar = tqdm(total=len(specs), desc="requests", disable=not progress)

    async def one(spec: RequestSpec) -> RequestResult:
        async with limit:
            result = await client.complete(spec.prompt, spec.output_len)
        bar.update(1)
        return result

    tasks = []
    for spec in specs:
        tasks.append(asyncio.ensure_future(one(spec)))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    bar.close()
    return list(results)


async def run_sessions(client: BenchClient, sessions: list[Session], max_concurrency: int | None,
                       progress: bool = True) -> list[RequestResult]:
    """Multi-turn: sessions run concurrently, each turn waits for the previous answer."""
    limit = asyncio.Semaphore(max_concurrency or len(sessions) or 1)
    total = sum(len(s.user_turns) for s in sessions)
    bar = tqdm(total=total, desc="turns", disable=not progress)

    async def one(session: Session) -> list[RequestResult]:
        conversation, results = _Conversation(session), []
        async with limit:
            for turn, user_turn in enumerate(session.user_turns):
                result = await client.complete(conversation.ask(user_turn), session.output_len)
                result.turn = turn
                conversation.answered(result.output_text)
                results.append(result)
                bar.update(1)
        return results

    nested = await asyncio.gather(*(one(s) for s in sessions))
    bar.close()
    return [r for results in nested for r in results]


async def run_sessions_interleaved(client: BenchClient, sessions: list[Session],
                                   max_concurrency: int | None,
                                   progress: bool = True) -> list[RequestResult]:
    """Agent sessions revisited after the others: round t asks every session's turn t (at most
    `max_concurrency` at once) and the next round starts when all have answered, so between
    two turns of a session every other session's context has gone through the server's KV
    cache. Results carry (session, turn) order: session-major."""
    limit = asyncio.Semaphore(max_concurrency or len(sessions) or 1)
    conversations = [_Conversation(session) for session in sessions]
    results: list[list[RequestResult]] = [[] for _ in sessions]
    rounds = max((len(s.user_turns) for s in sessions), default=0)
    bar = tqdm(total=sum(len(s.user_turns) for s in sessions), desc="turns",
               disable=not progress)

    async def ask(index: int, turn: int) -> None:
        session, conversation = sessions[index], conversations[index]
        async with limit:
            result = await client.complete(conversation.ask(session.user_turns[turn]),
                                           session.output_len)
        result.turn = turn
        conversation.answered(result.output_text)
        results[index].append(result)
        bar.update(1)

    for turn in range(rounds):
        await asyncio.gather(*(ask(index, turn) for index, session in enumerate(sessions)
                               if turn < len(session.user_turns)))
    bar.close()
    return [result for session_results in results for result in session_results]


class _Conversation:
    """A session's history as the prompt text of its next turn."""

    def __init__(self, session: Session):
        self.session = session
        self.history = session.system_prompt  # the plain frame's text so far
        self.messages: list[dict] = (  # the chat template's messages so far
            [{"role": "system", "content": session.system_prompt}] if session.system_prompt
            else [])

    def ask(self, user_turn: str) -> str:
        session = self.session
        if session.render is None:
            self.history += f"\nUser: {user_turn}\nAssistant:{session.answer_start}"
            return self.history
        self.messages.append({"role": "user", "content": user_turn})
        return session.render(self.messages) + session.answer_start

    def answered(self, text: str) -> None:
        if self.session.render is None:
            self.history += text
        else:
            self.messages.append({"role": "assistant",
                                  "content": self.session.answer_start + text})
