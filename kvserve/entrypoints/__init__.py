"""Entry points: the offline LLM class, the CLI and (later) the OpenAI-compatible server."""
