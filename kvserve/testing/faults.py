"""Test-only fault injection, so the reliability suites can make one request fail inside the engine.

Off unless the process was started with KVSERVE_FAULT_INJECTION=1 (or a test sets
`engine.faults = FaultInjector(True)`): a request field alone never turns it on. When on, a
request whose prompt text contains `kvserve-fault:<kind>` triggers the fault `<kind>`:
`execute` (the batched forward raises), `output` (output processing raises) or `engine_thread`
(a BaseException kills the AsyncEngine's thread).
"""

from __future__ import annotations

import os
from typing import Iterable

ENV_VAR = "KVSERVE_FAULT_INJECTION"
MARKER = "kvserve-fault:"
KINDS = ("execute", "output", "engine_thread")


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

    def maybe_raise(self, kind: str, prompts: Iterable[str | None]) -> None:
        """Raise the fault `kind` if it is enabled and one of `prompts` asks for it."""
        if not self.enabled:
            return
        tag = MARKER + kind
        if any(prompt and tag in prompt for prompt in prompts):
            if kind == "engine_thread":
                raise InjectedEngineDeath(tag)
            raise InjectedFault(f"injected fault ({tag})")
