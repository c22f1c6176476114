"""One OpenAI call as it travels from the ingress to an engine replica through a DeploymentHandle.

It carries the raw body, so the replica's own FastAPI app validates it exactly as the plain
server does, and exposes `.prompt` / `.messages` only when the body has them, because that is
how Ray's PrefixCacheAffinityRouter finds a request's text (it takes the first argument having
either attribute). The parsed JSON is cached but never pickled: only the bytes cross to the
replica.
"""

from __future__ import annotations

import json
from typing import Any


class OpenAIRequest:
    def __init__(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                 method: str = "POST"):
        self.method = method
        self.path = path
        self.body = body
        self.headers = headers  # (lower-case name, value), forwarded to the replica's app

    @property
    def payload(self) -> dict | None:
        """The body as a JSON object, or None (the replica's app answers a bad one with 400)."""
        if "_payload" not in self.__dict__:
            try:
                payload = json.loads(self.body)
            except ValueError:
                payload = None
            self.__dict__["_payload"] = payload if isinstance(payload, dict) else None
        return self.__dict__["_payload"]

    @property
    def stream(self) -> bool:
        return bool(self.payload and self.payload.get("stream") is True)

    def __getattr__(self, name: str) -> Any:
        # only for attributes not found normally: Ray's prefix router probes these two
        if name in ("prompt", "messages"):
            payload = self.payload
            value = payload.get(name) if payload else None
            if _text_like(value):
                return value
        raise AttributeError(name)

    def __getstate__(self) -> dict:
        return {"method": self.method, "path": self.path, "body": self.body,
                "headers": self.headers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _text_like(value: Any) -> bool:
    """A prompt string, a list of prompt strings, or a list of chat messages: what Ray's prefix
    router can turn into text (token-id prompts it cannot: it would divide by a zero length)."""
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(
        isinstance(item, (str, dict)) for item in value)
