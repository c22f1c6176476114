"""Speculative decoding: proposers of draft tokens, the speculative config, and the step-cost
model that decides how many drafts a step carries (docs/architecture.md, "Speculative
decoding")."""
