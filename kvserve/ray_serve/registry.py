"""The request routers living in this process, by deployment ("app#deployment"), so the ingress
can show the KV-aware router's view in /router/state.

Not a global of router.py: Ray Serve ships a request router's module by value (cloudpickle's
`register_pickle_by_value` in `RequestRouterConfig`), so the router's copy of router.py has
globals of its own; this module is imported by reference like the rest of kvserve.
"""

from __future__ import annotations

ROUTERS: dict[str, object] = {}


def key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}#{deployment_name}"
