"""Ray Serve LLM's PrefixCacheAffinityRouter, for comparing with ours on the same replicas.

Imported from its implementation module: the public `ray.serve.llm.request_router` imports
`ray.serve.llm`, whose configs need pyarrow (and the rest of `ray[llm]`), which kvserve does not
install; the class itself needs neither. One change: a request whose prompt has no text (token
ids) is routed by its power-of-two fallback, where Ray's version raises or divides by zero.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)


class TextPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request):
        try:
            text = super()._extract_text_from_request(pending_request)
        except ValueError:  # no `.prompt` / `.messages` with text (OpenAIRequest hides them)
            return None
        return text or None
