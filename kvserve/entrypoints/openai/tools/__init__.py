"""Tool calling for chat completions: tools described to the model (by its chat template, or
by kvserve's default Hermes-style system prompt when the template has none), the output
constrained by a grammar so every call parses and matches its parameters' schema, and the
calls parsed back into OpenAI's `tool_calls` (whole, or streamed as deltas)."""
