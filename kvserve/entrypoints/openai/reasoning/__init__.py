"""Reasoning models' thinking, split from their answers (`--reasoning-parser`, vLLM's names):
the parsers (parser.py), the grammar that constrains only the answer after the thinking
(grammar.py); gpt-oss's harmony channels are read by ../harmony.py."""
