"""Workers: one rank's model shard, its KV tensors and the model runner, whatever executor holds
them (the core's process, a worker process, a Ray actor). Requests arrive as ExecuteSteps
(kvserve.protocol.worker) and live here as one CachedRequestState each."""
