"""How much does serving over HTTP (engine on a thread in the server process) cost against the
offline engine on the same workload? Decides whether the engine needs its own process.

Usage: .venv/bin/python benchmarks/http_overhead.py [--concurrency 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from kvserve import LLM, SamplingParams
from kvserve.testing.server import ServerProcess


async def _http_run(base_url: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    async def one(client, prompt):
        tokens = 0
        async with client.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await one(client, "warm up")
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in prompts))
        return time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = [f"Write a short note about topic number {i}." for i in range(args.concurrency)]

    with ServerProcess(["--disable-log-requests"]) as server:
        http_seconds, http_tokens = asyncio.run(_http_run(server.base_url, prompts,
                                                          args.max_tokens))
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["warm up"], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    offline_seconds = time.perf_counter() - start
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    http_rate, offline_rate = http_tokens / http_seconds, offline_tokens / offline_seconds
    print(f"concurrency {args.concurrency}, {args.max_tokens} tokens each")
    print(f"HTTP (engine thread in the server process): {http_rate:.1f} tok/s")
    print(f"offline LLM.generate:                        {offline_rate:.1f} tok/s")
    print(f"HTTP / offline: {http_rate / offline_rate:.2f}")


if __name__ == "__main__":
    main()
