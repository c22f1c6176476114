"""The pooling API (--runner pooling): OpenAI's /v1/embeddings, vLLM's /pooling and /score, and
the Jina/Cohere-shaped /rerank: request schemas (protocol.py) and response bodies
(responses.py); the routes are routes/pooling.py."""
