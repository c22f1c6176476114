"""A closed loop of clients, as `kvserve bench serve --max-concurrency B` runs one, simulated
step by step on an instance's step costs.

Why a simulation and not a queueing formula: with fixed lengths a closed loop does not settle
into spread-out arrivals. Requests admitted in the same step finish in the same step, their
clients send the next ones together, and those prompts then share (or queue for) the next
steps' token budget. Their TTFT is that of a small burst, not of a lone prompt, and the
decodes of the others stall behind it. Which prompts meet depends on the token budget and
the lengths, so the engine's own scheduling is replayed:

- Each step the running requests go first: a decode takes one token, a prompt still being
  prefilled the rest of its tokens (chunked to what the budget has left).
- Then waiting prompts are admitted in arrival order while budget and `max_num_seqs` allow.
- A prompt's first token comes out of the step that computes its last prompt token.
- A client sends its next request when its last token arrives. That request reaches the
  engine while the next step already runs, so it is scheduled in the step after. An idle
  engine steps as soon as the first request reaches it: requests sent together (the first
  wave, or clients finishing in one step) arrive a little apart (HTTP, tokenizing), so the
  first is prefilled alone and the others arrive during its step.

It returns what the bench reports: median TTFT and TPOT over the requests, and output tokens
per second over the run.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

# seconds of one step: (decoding sequences, prompt tokens computed, mean decode context)
StepCost = Callable[[int, int, float], float]


@dataclass
class _Request:
    prompt_left: int
    sent_s: float
    decoded: int = 0
    first_s: float | None = None
    done_s: float | None = None


@dataclass(frozen=True)
class ClosedLoop:
    ttft_s: float  # median over requests
    tpot_s: float  # median over requests of (done - first token) / (output - 1)
    throughput: float  # output tokens per second of the whole run
    steps: int


@dataclass(frozen=True)
class LoopShape:
    clients: int
    requests: int
    prompt_len: int
    output_len: int
    token_budget: int
    max_num_seqs: int = 256


def closed_loop(step_cost: StepCost, shape: LoopShape) -> ClosedLoop:
    """Replay the engine's steps until every request of the run has finished."""
    first_wave = min(shape.clients, shape.requests)
    # sent before or during the last step: schedulable after the next one
    arriving = [_Request(shape.prompt_len, 0.0) for _ in range(first_wave)]
    sent, now, steps = first_wave, 0.0, 0
    running: list[_Request] = []
    waiting: deque[_Request] = deque()
    finished: list[_Request] = []
    while running or waiting or arriving:
        if not running and not waiting:  # idle: the first to arrive is stepped at once
            waiting.append(arriving.pop(0))
        prefilled, decoding, prompt_tokens = _schedule(running, waiting, shape)
        context = (sum(shape.prompt_len + r.decoded for r in decoding) / len(decoding)
                   if decoding else 0.0)
        now += step_cost(len(decoding), prompt_tokens, context)
        steps += 1
        waiting.extend(arriving)
        arriving = []
        for request in prefilled:
            request.first_s, request.decoded = now, 1
        for request in decoding:
            request.decoded += 1
        for request in [r for r in running if r.decoded >= shape.output_len]:
            request.done_s = now
            running.remove(request)
            finished.append(request)
            if sent < shape.requests:
                arriving.append(_Request(shape.prompt_len, now))
                sent += 1
    return _summary(finished, shape.output_len, now, steps)


def _schedule(running: list[_Request], waiting: deque, shape: LoopShape
              ) -> tuple[list[_Request], list[_Request], int]:
    """This step's work: (prompts finishing their prefill, decoding requests, prompt
    tokens computed), running requests first, then waiting ones in order."""
    budget, prompt_tokens = shape.token_budget, 0
    prefilled, decoding = [], []
    for request in running:
        if budget <= 0:
            break
        if request.prompt_left:
            budget, prompt_tokens = _chunk(request, budget, prompt_tokens, prefilled)
        else:
            decoding.append(request)
            budget -= 1
    while waiting and budget > 0 and len(running) < shape.max_num_seqs:
        request = waiting.popleft()
        running.append(request)
        budget, prompt_tokens = _chunk(request, budget, prompt_tokens, prefilled)
    return prefilled, decoding, prompt_tokens


def _chunk(request: _Request, budget: int, prompt_tokens: int, prefilled: list
           ) -> tuple[int, int]:
    take = min(request.prompt_left, budget)
    request.prompt_left -= take
    if not request.prompt_left:
        prefilled.append(request)
    return budget - take, prompt_tokens + take


def _summary(finished: list[_Request], output_len: int, end_s: float, steps: int
             ) -> ClosedLoop:
    ttft = statistics.median(r.first_s - r.sent_s for r in finished)
    tpot = statistics.median((r.done_s - r.first_s) / (output_len - 1) for r in finished) \
        if output_len > 1 else 0.0
    return ClosedLoop(ttft, tpot, len(finished) * output_len / end_s, steps)


@dataclass(frozen=True)
class SplitCosts:
    """A prefill/decode pair's step costs: seconds of a prefill step of that many prompt
    tokens, of a decode step (sequences, mean context), and of one prompt's KV transfer."""
    prefill: Callable[[int], float]
    decode: Callable[[int, float], float]
    transfer_s: float


def disaggregated_loop(costs: SplitCosts, shape: LoopShape) -> ClosedLoop:
    """The closed loop on a prefill server and a decode server, each stepping on its own
    clock (events in time order): the prefill server takes waiting prompts whole, as many as
    its token budget holds (a longer one alone, chunk by chunk), and hands each one's KV over
    (`transfer_s`); the decode server admits what has arrived at the start of each step and
    makes a request's first token in its first step there; a client sends again when its
    last token comes. A server idle when work arrives starts at once: a prefill server on the
    first of prompts sent together (as simulate's engine does), a decode server on all the
    prompts of one prefill step."""
    import heapq
    import itertools

    order = itertools.count()
    events: list = []

    def at(time_s: float, kind: str, payload) -> None:
        heapq.heappush(events, (time_s, next(order), kind, payload))

    first_wave = min(shape.clients, shape.requests)
    for _ in range(first_wave):
        at(0.0, "send", _Request(shape.prompt_len, 0.0))
    sent, steps, end = first_wave, 0, 0.0
    prompts: deque[_Request] = deque()
    arrived: list[_Request] = []
    running: list[_Request] = []
    finished: list[_Request] = []
    prefilling = decoding = False
    while events:
        now, _, kind, payload = heapq.heappop(events)
        end = max(end, now)
        if kind == "send":
            prompts.append(payload)
        elif kind == "prefilled":
            prefilling = False
            for request in payload:
                at(now + costs.transfer_s, "arrived", request)
        elif kind == "arrived":  # one prefill step's prompts reach the decode server together
            arrived.append(payload)
            while events and events[0][0] == now and events[0][2] == "arrived":
                arrived.append(heapq.heappop(events)[3])
        else:  # a decode step ended
            decoding = False
            for request in payload:
                request.decoded += 1
                if request.first_s is None:
                    request.first_s = now
                if request.decoded >= shape.output_len:
                    request.done_s = now
                    running.remove(request)
                    finished.append(request)
                    if sent < shape.requests:
                        at(now, "send", _Request(shape.prompt_len, now))
                        sent += 1
        if not prefilling and prompts:
            batch = _whole_prompts(prompts, shape.token_budget)
            at(now + _prefill_s(costs, batch, shape.token_budget), "prefilled", batch)
            prefilling, steps = True, steps + 1
        if not decoding and (running or arrived):
            room = max(0, shape.max_num_seqs - len(running))
            running.extend(arrived[:room])
            del arrived[:room]
            context = sum(shape.prompt_len + r.decoded for r in running) / len(running)
            at(now + costs.decode(len(running), context), "decoded", list(running))
            decoding, steps = True, steps + 1
    return _summary(finished, shape.output_len, end, steps)


def _whole_prompts(prompts: deque, budget: int) -> list[_Request]:
    batch = [prompts.popleft()]
    tokens = batch[0].prompt_left
    while prompts and tokens + prompts[0].prompt_left <= budget:
        tokens += prompts[0].prompt_left
        batch.append(prompts.popleft())
    return batch


def _prefill_s(costs: SplitCosts, batch: list[_Request], budget: int) -> float:
    """A batch of whole prompts in one step, or one prompt longer than the budget in
    chunks of it."""
    tokens = sum(r.prompt_left for r in batch)
    full, rest = divmod(tokens, budget) if len(batch) == 1 else (0, tokens)
    return full * costs.prefill(budget) + (costs.prefill(rest) if rest else 0.0)
