"""What constrains a thinking reply: structured output and tool grammars apply to the answer
after `</think>`, never to the thinking (vLLM leaves the thinking free as well), and the
thinking budget's markers as token ids.

The request's own constraint (any kind: a JSON schema, a regex, choices, EBNF or Lark, a
structural tag, the tools' tag) is built as xgrammar builds it alone, and its EBNF becomes the
answer part of a structural tag: free text up to `</think>` (opened by the prompt, or by a
`<think>` the reply may start with), a short run of whitespace, then the constraint. So the
answer follows exactly the grammar it would follow without thinking.
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.reasoning.parser import THINK_END, THINK_START, ThinkingPlan
from kvserve.sampling_params import StructuredOutputsParams, ThinkingMarkers

# what reasoning models write between </think> and the answer ("\n\n"): spaces and newlines
# only (a random model wrote vertical tabs under \s, which JSON does not take as whitespace)
SEPARATOR_PATTERN = r"[ \n]{0,2}"


def after_thinking(spec: StructuredOutputsParams, plan: ThinkingPlan
                   ) -> StructuredOutputsParams:
    """The constraint applied to the answer only (imports xgrammar: call it off the event
    loop)."""
    # xgrammar (and torch under it) only where a reasoning reply has a grammar: the API
    # front-end imports neither otherwise
    from kvserve.structured_output.compiler import build_grammar

    answer = {"type": "grammar", "grammar": str(build_grammar(spec))}
    thinking = {"type": "tag", "begin": "" if plan.inside else THINK_START,
                "content": {"type": "any_text"}, "end": THINK_END}
    elements = [thinking, {"type": "regex", "pattern": SEPARATOR_PATTERN}, answer]
    if not plan.inside:  # the model may think or not
        elements = [{"type": "optional", "content": {"type": "sequence",
                                                     "elements": elements[:2]}}, answer]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return StructuredOutputsParams(structural_tag=json.dumps(tag))


def thinking_markers(tokenizer, plan: ThinkingPlan) -> ThinkingMarkers:
    """The thinking budget's markers in the model's tokens."""
    return ThinkingMarkers(tokenizer.encode(THINK_START, add_special_tokens=False),
                           tokenizer.encode(THINK_END, add_special_tokens=False),
                           starts_inside=plan.inside)
