"""Prompt-lookup drafts (vLLM's `ngram` method): find the sequence's last n tokens earlier in it,
for the longest n in [prompt_lookup_min, prompt_lookup_max], and propose what followed them.

An incremental index per request (n-gram of prompt_lookup_min tokens -> where it ended) makes a
proposal cost microseconds whatever the length: each new token is indexed once, and a lookup
checks only the most recent occurrences of the last min-gram, extending each match backwards
up to prompt_lookup_max."""

from __future__ import annotations

from collections import defaultdict

# the most recent occurrences of a min-gram a lookup tries (the latest match usually continues
# the current text best; a bounded number keeps a lookup O(1))
CANDIDATES = 8


class _RequestIndex:
    def __init__(self, low: int):
        self.low = low
        self.ends: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)
        self.next_end = low  # the first end position not indexed yet

    def extend(self, tokens: list[int], stop: int) -> None:
        """Index the min-grams ending at every position up to `stop` not indexed yet (no copy
        of the list: a proposal costs what the new tokens do, whatever the length)."""
        low = self.low
        for end in range(self.next_end, stop + 1):
            self.ends[tuple(tokens[end - low:end])].append(end)
        self.next_end = max(self.next_end, stop + 1)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_drafts: int):
        self.low, self.high, self.max_drafts = prompt_lookup_min, prompt_lookup_max, max_drafts
        self._indexes: dict[str, _RequestIndex] = {}

    def propose(self, request_id: str, tokens: list[int], num_prompt_tokens: int = 0,
                ) -> list[int]:
        """Up to max_drafts tokens that followed the longest earlier occurrence of the
        sequence's suffix (the most recent among equally long ones); [] when none."""
        if len(tokens) <= self.low:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _RequestIndex(self.low)
        # index every min-gram ending before the last token (the suffix must not match itself)
        index.extend(tokens, len(tokens) - 1)
        candidates = index.ends.get(tuple(tokens[-self.low:]))
        if not candidates:
            return []
        best_end, best_length = -1, 0
        for end in reversed(candidates[-CANDIDATES:]):
            length = self._match_length(tokens, end)
            if length > best_length:
                best_end, best_length = end, length
                if length == self.high:
                    break
        return tokens[best_end:best_end + self.max_drafts]

    def _match_length(self, tokens: list[int], end: int) -> int:
        """How many tokens before `end` equal the sequence's last ones (low..high)."""
        length, last = self.low, len(tokens)
        while length < self.high and end - length - 1 >= 0 and \
                tokens[end - length - 1] == tokens[last - length - 1]:
            length += 1
        return length

    def finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
