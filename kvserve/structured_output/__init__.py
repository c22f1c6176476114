"""Structured output: grammars (JSON schema, regex, choice, EBNF, structural tags) compiled by
xgrammar in the front-end, and a logits processor on the sampling worker that masks every row
to the tokens its grammar allows."""
