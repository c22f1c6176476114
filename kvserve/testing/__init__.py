"""Helpers for tests and examples: a tiny random model and a minimal paged greedy loop."""
