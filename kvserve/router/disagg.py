"""The router's disaggregated mode: the prompt on a prefill server, the answer from a decode server.

Given --prefill and --decode URLs, the router sends a request to a prefill server first with
`max_tokens` 1 and `kv_transfer_params {"do_remote_decode": true}` (vLLM's proxy flow, not
streamed), then the client's own request, plus the handle the prefill server answered with, to
a decode server, which pulls the prompt's KV and generates. Both servers are chosen by the same
policy as aggregated replicas (kv-aware: the prefill server already holding most of the prompt,
the decode server by its load and what it holds).

The decode server prefills the prompt itself (no handle) when the prefill step cannot help or
fails: a prompt whose part not cached on the chosen decode server is at most
--max-local-prefill-length tokens (Dynamo's conditional disaggregation), a request with several
prompts or choices (one handle cannot serve them), no healthy prefill server, or prefill servers
that fail before answering (refused, reset, 5xx, an answer without a handle). A prefill server's
4xx is the client's error and goes back to it as it came. A prefill server that dies after
answering costs the decode server one transfer timeout, then it recomputes (kv_transfer), and
a decode server that never pulls costs the prefill server the hold timeout.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvserve.router.policy import Candidate
from kvserve.router.prompts import CHAT_PATH, cache_salt_of

if TYPE_CHECKING:
    from kvserve.router.app import Router

logger = logging.getLogger(__name__)

PREFILL_REPLICA_HEADER = "X-Kvserve-Prefill-Replica"
# request fields the prefill step drops: it answers one token, unstreamed, for one prompt
_PREFILL_DROPPED = ("stream", "stream_options", "min_tokens", "max_completion_tokens")


@dataclass
class PrefillOutcome:
    body: bytes | None = None  # the decode request (the client's, plus the handle), or None
    response: Response | None = None  # the prefill server's client error, for the client
    headers: dict = field(default_factory=dict)  # for the client's answer


def prefill_request(payload: dict) -> dict:
    """The client's request as the prefill step sends it: same prompt and sampling, one token,
    not streamed, held for a decode server."""
    body = {k: v for k, v in payload.items() if k not in _PREFILL_DROPPED}
    body.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    body.pop("best_of", None)
    return body


def local_prefill_reason(path: str, payload, token_ids: list[int] | None,
                         decode_choice: Candidate, block_size: int,
                         max_local_prefill_length: int) -> str | None:
    """Why the decode server should prefill this request itself, or None to disaggregate."""
    if not isinstance(payload, dict) or token_ids is None:
        return "unreadable"  # the decode server answers it (with its own 400 if it is bad)
    if payload.get("n", 1) != 1 or (payload.get("best_of") or 1) != 1:
        return "several_choices"
    prompt = payload.get("prompt") if path != CHAT_PATH else None
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return "several_prompts"
    uncached = len(token_ids) - decode_choice.overlap_blocks * block_size
    if uncached <= max_local_prefill_length:
        return "short"
    return None


class PrefillStage:
    """Runs the prefill step of one request on the best prefill server (the next one if it
    fails before answering)."""

    def __init__(self, router: "Router"):
        self.router = router

    async def run(self, raw: Request, path: str, payload, token_ids: list[int] | None,
                  headers: dict, decode_choice: Candidate, block_size: int) -> PrefillOutcome:
        router = self.router
        reason = local_prefill_reason(path, payload, token_ids, decode_choice, block_size,
                                      router.config.max_local_prefill_length)
        ranked, prompt_blocks = router.rank(token_ids, "prefill", cache_salt_of(payload))
        if reason is None and not ranked:
            reason = "no_prefill_replica"
        if reason is not None:
            router.metrics.local_prefills.labels(reason).inc()
            return PrefillOutcome()
        content = json.dumps(prefill_request(payload)).encode()
        for attempt, candidate in enumerate(ranked[:2]):
            outcome = await self._try(raw, candidate, path, payload, content, headers,
                                      prompt_blocks)
            if outcome is not None:
                return outcome
            if attempt == 0 and len(ranked) > 1:
                router.metrics.retries.inc()
        router.metrics.local_prefills.labels("prefill_failed").inc()
        return PrefillOutcome()

    async def _try(self, raw: Request, candidate: Candidate, path: str, payload: dict,
                   content: bytes, headers: dict, prompt_blocks: int) -> PrefillOutcome | None:
        """The outcome from this prefill server, or None when it failed before answering."""
        router = self.router
        replica = router.replicas[candidate.name]
        serial = next(router._serial)
        replica.inflight[serial] = prompt_blocks + 1
        started = time.monotonic()
        try:
            response = await router.until_disconnected(raw, router.http.post(
                replica.url + path, content=content, headers=headers))
        except httpx.HTTPError as exc:
            router.metrics.failures.labels(replica.url).inc()
            router.monitor.mark_down(replica, f"{type(exc).__name__}: {exc}")
            return None
        finally:
            replica.inflight.pop(serial, None)
        if response is None:  # the client went away: nothing more to do for it
            return PrefillOutcome(response=Response(status_code=499))
        if 400 <= response.status_code < 500:
            return PrefillOutcome(response=Response(
                response.content, status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers={PREFILL_REPLICA_HEADER: replica.url}))
        handle = _handle(response)
        if handle is None:
            router.metrics.failures.labels(replica.url).inc()
            logger.warning("prefill server %s answered %d without a KV handle (is it started "
                           "with --kv-role prefill?); the decode server prefills",
                           replica.url, response.status_code)
            return None
        router.metrics.requests.labels(replica.url).inc()
        router.metrics.prefill_seconds.observe(time.monotonic() - started)
        router.metrics.remote_prefills.inc()
        return PrefillOutcome(body=json.dumps({**payload, "kv_transfer_params": handle}).encode(),
                              headers={PREFILL_REPLICA_HEADER: replica.url})


def _handle(response: httpx.Response) -> dict | None:
    if response.status_code != 200:
        return None
    try:
        handle = response.json().get("kv_transfer_params")
    except ValueError:
        return None
    return handle if isinstance(handle, dict) and handle.get("do_remote_prefill") else None
