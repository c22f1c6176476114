"""The engine core: the scheduler, the KV cache manager (`kv_cache/`) and the executor; token
ids in, token deltas out. It runs on a thread of the front-end or in its own process."""
