"""KV offload tiers: blocks the prefix cache evicts are kept in host memory and/or on disk,
content-addressed by their chained block hash, and loaded back for a later request whose prefix
misses the pool, instead of being recomputed. One KV connector (connector.py) on the connector
API of kv_transfer/base.py, fed by the block pool's evictions; the disk tier (store.py)
outlives a restart."""
