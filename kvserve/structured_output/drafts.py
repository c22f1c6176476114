"""Grammar-aware drafts, in the engine core: where a constrained request's grammar forces the
next characters (a JSON key, the punctuation between fields, a const), that span, tokenized, is
proposed as speculative drafts, so constrained output can go faster than free text; elsewhere
the context proposer's drafts are cut at the first token the grammar forbids, so no verified
position is spent on a draft that cannot be accepted. The workers still verify every draft
against the model (masked by the same grammar): what is emitted stays exactly what the model
would emit without drafts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler


@dataclass
class _Follower:
    matcher: Any
    consumed: int = 0
    broken: bool = False

    def follow(self, outputs: list[int]) -> None:
        while self.consumed < len(outputs) and not self.broken:
            self.broken = not self.matcher.accept_token(outputs[self.consumed])
            self.consumed += 1


class GrammarDrafts:
    def __init__(self, compiler: GrammarCompiler, tokenizer_loader, max_drafts: int):
        """`compiler`: the engine core's (`shared_compiler`), where the core's gate compiled
        each request's grammar before the request could run."""
        self.compiler = compiler
        self.max_drafts = max_drafts
        self._tokenizer_loader = tokenizer_loader
        self._tokenizer = None
        self._followers: dict[str, _Follower] = {}

    def drafts(self, request_id: str, spec: StructuredOutputsParams, outputs: list[int],
               proposed: list[int]) -> tuple[list[int], bool]:
        """The drafts for a constrained request, and whether they are a forced span: the span
        its grammar forces next, else `proposed` up to the first token the grammar does not
        allow."""
        follower = self._follower(request_id, spec)
        if follower is None:
            return proposed, False
        follower.follow(outputs)
        if follower.broken or follower.matcher.is_terminated():
            return [], False
        matcher = follower.matcher
        forced = self._forced_tokens(matcher)
        # the context's drafts where they begin with the forced span: they may go further
        span = bool(forced) and proposed[:len(forced)] != forced
        candidates = forced if span else proposed
        kept = []
        for token in candidates[:self.max_drafts]:
            if not matcher.accept_token(token):
                break
            kept.append(token)
        if kept:
            matcher.rollback(len(kept))
        return kept, span

    def finish(self, request_id: str) -> None:
        self._followers.pop(request_id, None)

    # ---- inside -----------------------------------------------------------------------------
    def _follower(self, request_id: str, spec: StructuredOutputsParams) -> _Follower | None:
        follower = self._followers.get(request_id)
        if follower is None:
            future = self.compiler.submit(spec)
            if not future.done():  # evicted from the cache and compiling again: no drafts yet
                return None
            try:
                grammar = future.result()
            except Exception:  # the gate compiled it; proposing is only an optimisation
                return None
            follower = _Follower(self.compiler.matcher(grammar))
            self._followers[request_id] = follower
        return follower

    def _forced_tokens(self, matcher) -> list[int]:
        """The tokens the grammar forces next. llguidance knows them; for xgrammar, the
        forced text tokenized, less its last token, which may merge with the free text after
        it (a key's `name"` before a free-whitespace `:`: the model writes `name`, `":`)."""
        if hasattr(matcher, "forced_tokens"):
            return matcher.forced_tokens()
        text = matcher.find_jump_forward_string()
        return self._encode(text)[:-1] if text else []

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_loader()
        return self._tokenizer.encode(text, add_special_tokens=False)
