"""OpenAI batch files offline (`kvserve run-batch`, vLLM's `run-batch`): each line through the
server's own routes in this process, results appended line by line and resumable after a
crash."""

from kvserve.entrypoints.openai.batch.runner import RunBatchConfig, run_batch

__all__ = ["RunBatchConfig", "run_batch"]
