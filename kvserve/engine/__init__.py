"""The engine front-end: input processing (chat template, tokenize, validate), output
processing (detokenize, stop strings, n > 1) and the client of the engine core (on a thread
of this process or in its own process). Callers (server, LLM, CLI) use `LLMEngine` or
`AsyncEngine`; nothing here touches tensors."""
