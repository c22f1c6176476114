"""Test-only fault injection, so the reliability suites can make one request fail inside the
engine. It is a general plugin (kvserve/plugins.py): nothing in the package imports it.

A process runs it when `KVSERVE_PLUGINS` names `kvserve.testing.faults:register` (servers
started by tests; child processes inherit it), or when a test calls `enable()` in its own
process. Then a request whose prompt text contains `kvserve-fault:<kind>` triggers the fault
`<kind>`:

- `execute`: the worker's batched step raises (the engine core re-runs each request alone and
  fails only the one that asked);
- `output`: the front-end's output processing of that request raises;
- `engine_thread`: a BaseException from the worker ends the engine core's loop (its thread, or
  its process);
- `kv_send`: a prefill engine holds the request's KV for a decode engine but its senders never
  answer the pull (a prefill server hung, or dying, mid-transfer).

The hooks wrap the real classes (Worker, SampleState) and read the prompt's text with the
model's own tokenizer, so no fault field crosses the wire.
"""

from __future__ import annotations

import functools
from typing import Iterable

from kvserve.testing.plugin_switch import PluginSwitch

MARKER = "kvserve-fault:"
KINDS = ("execute", "output", "engine_thread", "kv_send")
PLUGIN = "kvserve.testing.faults:register"

_tokenizers: dict[str, object] = {}


class InjectedFault(RuntimeError):
    """An exception raised on purpose inside the engine."""


class InjectedEngineDeath(BaseException):
    """Escapes `except Exception`, so it ends the engine thread like an unforeseen crash."""


def kinds_asked(prompt: str | None) -> list[str]:
    """The fault kinds `prompt` asks for, while on (else none)."""
    if not _switch.enabled or not prompt:
        return []
    return [kind for kind in KINDS if MARKER + kind in prompt]


def raise_fault(kind: str) -> None:
    tag = MARKER + kind
    if kind == "engine_thread":
        raise InjectedEngineDeath(tag)
    raise InjectedFault(f"injected fault ({tag})")


def _prompt_text(model: str, token_ids: Iterable[int]) -> str:
    tokenizer = _tokenizers.get(model)
    if tokenizer is None:
        from kvserve.model_source import resolve_model
        from kvserve.tokenizer import load_tokenizer

        tokenizer = _tokenizers[model] = load_tokenizer(resolve_model(model))
    return tokenizer.decode(list(token_ids))


def _install() -> None:
    _install_worker_hook()
    _install_output_hook()


def _install_worker_hook() -> None:
    """`execute` and `engine_thread`: raised from the worker's model step when a scheduled
    request's prompt asks (a request's kinds are read once, when the worker first sees it).
    `kv_send`: the rank's KV sender is told then never to answer pulls of that request."""
    from kvserve.worker.worker import Worker

    original = Worker.execute_model

    @functools.wraps(original)
    def execute(self, step):
        asked = self.__dict__.setdefault("_fault_kinds", {})
        for new in step.new_requests:
            if new.request_id not in asked:
                asked[new.request_id] = kinds_asked(
                    _prompt_text(self.config.model, new.prompt_token_ids))
                if "kv_send" in asked[new.request_id]:
                    _stall_sends(self, new.request_id)
        for request_id in step.finished_ids:
            asked.pop(request_id, None)
        kinds = {kind for item in step.scheduled for kind in asked.get(item.request_id, ())}
        for kind in ("engine_thread", "execute"):
            if kind in kinds and _switch.enabled:
                raise_fault(kind)
        return original(self, step)

    Worker.execute_model = execute


def _stall_sends(worker, request_id: str) -> None:
    leases = getattr(worker.kv_connector, "leases", None)  # TcpConnector's worker side
    if leases is not None:
        leases.stall(request_id)


def _install_output_hook() -> None:
    """`output`: the front-end's processing of each delta of such a request raises."""
    from kvserve.engine.output_processor import SampleState

    original_init, original_add = SampleState.__init__, SampleState.add_delta

    @functools.wraps(original_init)
    def init(self, request_id, group_id, index, prompt_token_ids, params, tokenizer, *args,
             **kwargs):
        original_init(self, request_id, group_id, index, prompt_token_ids, params, tokenizer,
                      *args, **kwargs)
        self._fault_kinds = kinds_asked(tokenizer.decode(list(prompt_token_ids)))

    @functools.wraps(original_add)
    def add_delta(self, *args, **kwargs):
        if "output" in getattr(self, "_fault_kinds", ()) and _switch.enabled:
            raise_fault("output")
        return original_add(self, *args, **kwargs)

    SampleState.__init__, SampleState.add_delta = init, add_delta


_switch = PluginSwitch(_install)
register = _switch.register  # KVSERVE_PLUGINS entry point: faults on in this process
enable = _switch.enable  # a test's own process: faults on (True) or off (False)
