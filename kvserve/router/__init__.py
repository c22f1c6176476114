"""`kvserve router`: an OpenAI-compatible front that places each request on one of several
replicas (kv-aware, round-robin or least-loaded), knowing from the replicas' KV events which of
them holds which prefix blocks (docs/architecture.md, "KV events and the router")."""
