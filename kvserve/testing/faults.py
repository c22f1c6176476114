"""Test-only fault injection, so the reliability suites can make one request fail inside the engine.

Off unless the process was started with KVSERVE_FAULT_INJECTION=1 (or a test sets
`engine.faults = FaultInjector(True)`): a request field alone never turns it on. When on, a
request whose prompt text contains `kvserve-fault:<kind>` triggers the fault `<kind>`:
`execute` (the batched forward raises), `output` (output processing raises), `engine_thread`
(a BaseException ends the engine core's loop: its thread, or its process) or `kv_send` (a
prefill engine holds the request's KV for a decode engine but its sender never answers the
pull: a prefill server hung, or dying, mid-transfer).

The front-end reads the markers from the prompt text and, only while it is on, tags the request
with the kinds it asks for (`EngineCoreRequest.faults`); the engine core, in this process or in
its own, acts on the tags alone and never reads the switch.
"""

from __future__ import annotations

import os
from typing import Iterable

ENV_VAR = "KVSERVE_FAULT_INJECTION"
MARKER = "kvserve-fault:"
KINDS = ("execute", "output", "engine_thread", "kv_send")


class InjectedFault(RuntimeError):
    """An exception raised on purpose inside the engine."""


class InjectedEngineDeath(BaseException):
    """Escapes `except Exception`, so it ends the engine thread like an unforeseen crash."""


class FaultInjector:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled

    @classmethod
    def from_env(cls) -> "FaultInjector":
        return cls(os.environ.get(ENV_VAR) == "1")

    def kinds_asked(self, prompt: str | None) -> list[str]:
        """The fault kinds `prompt` asks for, while on (else none)."""
        if not self.enabled or not prompt:
            return []
        return [kind for kind in KINDS if MARKER + kind in prompt]

    def maybe_raise(self, kind: str, prompts: Iterable[str | None]) -> None:
        """Raise the fault `kind` if it is enabled and one of `prompts` asks for it."""
        if self.enabled and any(kind in self.kinds_asked(prompt) for prompt in prompts):
            raise_fault(kind)


def raise_tagged(kind: str, tags: Iterable[list[str]]) -> None:
    """In the engine core: raise the fault `kind` if one of the requests' tags holds it."""
    if any(kind in request_tags for request_tags in tags):
        raise_fault(kind)


def raise_fault(kind: str) -> None:
    tag = MARKER + kind
    if kind == "engine_thread":
        raise InjectedEngineDeath(tag)
    raise InjectedFault(f"injected fault ({tag})")
