"""Suffix drafts (vLLM's `suffix` method, the SuffixDecoding idea): match the longest recent
suffix of the sequence against the request's own prompt and output and against a bounded store
of recent requests' outputs, then draft the continuation the matches agree on.

Where prompt lookup takes a fixed n and one occurrence, this takes the longest match (up to
`max_tree_depth` tokens) over every occurrence, and walks forward through what followed those
occurrences: each next token is the most frequent one among the occurrences still consistent
with the draft so far, and the draft stops where the product of those frequencies (the
estimated chance the whole draft is right) drops below `min_token_prob`, or at
`max_spec_factor` times the match length. A suffix tree over the occurrences gives the same
counts; an index of bigrams to their positions (incremental per request, and one over the
cached outputs holding each bigram's latest occurrences) gives them without building one."""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque

KEY = 2  # tokens of the bigram occurrences are found by; a match is at least this long
CANDIDATES = 64  # the most recent occurrences of the last bigram a proposal looks at, in the
# request's own tokens and in the cached outputs each


class _Sequence:
    """A token list and the positions after each bigram in it, indexed incrementally."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.after: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
        self.next_end = KEY

    def index_to(self, end: int) -> None:
        """Index the bigrams ending at positions up to `end` (exclusive of later ones)."""
        tokens = self.tokens
        for stop in range(self.next_end, end + 1):
            self.after[(tokens[stop - 2], tokens[stop - 1])].append(stop)
        self.next_end = max(self.next_end, end + 1)


class SuffixProposer:
    def __init__(self, max_drafts: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        self.max_drafts, self.max_depth = max_drafts, max_tree_depth
        self.max_cached, self.spec_factor = max_cached_requests, max_spec_factor
        self.min_prob = min_token_prob
        self._active: dict[str, tuple[_Sequence, int]] = {}  # id -> (tokens, prompt length)
        self._cache: OrderedDict[str, _Sequence] = OrderedDict()  # recent outputs, oldest first
        # bigram -> its latest occurrences in the cached outputs (sequence, position after it):
        # a proposal looks one bigram up instead of asking every cached output (up to
        # max_cached_requests of them: 5.5 ms a proposal at 10,000 for a bigram they lack)
        self._recent: dict[tuple[int, int], deque[tuple[_Sequence, int]]] = {}

    def follow(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> _Sequence:
        """Track a request's tokens (the live list, which grows with its output) without
        proposing: when drafts cannot pay at the current batch the drafter asks for none, and
        the request's output must still join the store when it finishes."""
        entry = self._active.get(request_id)
        if entry is None or entry[0].tokens is not tokens:
            entry = self._active[request_id] = (_Sequence(tokens), num_prompt_tokens)
        return entry[0]

    def propose(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> list[int]:
        if len(tokens) < KEY + 1:
            return []
        own = self.follow(request_id, tokens, num_prompt_tokens)
        own.index_to(len(tokens) - 1)  # not the suffix itself
        key = (tokens[-2], tokens[-1])
        occurrences = [(own, after) for after in own.after.get(key, ())[-CANDIDATES:]]
        occurrences += self._recent.get(key, ())
        if not occurrences:
            return []
        lengths = [self._match_length(tokens, sequence.tokens, after)
                   for sequence, after in occurrences]
        longest = max(lengths)
        best = [occurrence for occurrence, length in zip(occurrences, lengths)
                if length == longest]
        limit = min(self.max_drafts, max(1, int(self.spec_factor * longest)))
        return self._walk(best, limit)

    def _match_length(self, tokens: list[int], other: list[int], after: int) -> int:
        """How many tokens before `after` in `other` equal the sequence's last ones."""
        length, end = KEY, len(tokens)
        while length < self.max_depth and after - length - 1 >= 0 and \
                other[after - length - 1] == tokens[end - length - 1]:
            length += 1
        return length

    def _walk(self, occurrences: list[tuple[_Sequence, int]], limit: int) -> list[int]:
        """The draft the occurrences' continuations agree on, token by token, while the
        estimated probability of the whole draft stays at least min_token_prob."""
        drafts, probability = [], 1.0
        for step in range(limit):
            following = Counter(sequence.tokens[after + step]
                                for sequence, after in occurrences
                                if after + step < len(sequence.tokens))
            if not following:
                break
            token, count = following.most_common(1)[0]
            probability *= count / sum(following.values())
            if probability < self.min_prob:
                break
            drafts.append(token)
            occurrences = [(sequence, after) for sequence, after in occurrences
                           if after + step < len(sequence.tokens)
                           and sequence.tokens[after + step] == token]
        return drafts

    def finish(self, request_id: str) -> None:
        """The request's output joins the store of recent outputs (the oldest leaves past
        max_cached_requests)."""
        entry = self._active.pop(request_id, None)
        if entry is None or self.max_cached <= 0:
            return
        sequence, prompt_length = entry
        output = list(sequence.tokens[prompt_length:])
        if len(output) <= KEY:
            return
        cached = _Sequence(output)
        cached.index_to(len(output))
        self._cache[request_id] = cached
        for key, positions in cached.after.items():
            recent = self._recent.setdefault(key, deque(maxlen=CANDIDATES))
            recent.extend((cached, after) for after in positions[-CANDIDATES:])
        while len(self._cache) > self.max_cached:
            self._forget(self._cache.popitem(last=False)[1])

    def _forget(self, evicted: _Sequence) -> None:
        """Drop an evicted output's occurrences from the bigram index."""
        for key in evicted.after:
            recent = self._recent.get(key)
            if recent is None:
                continue
            kept = [entry for entry in recent if entry[0] is not evicted]
            if kept:
                self._recent[key] = deque(kept, maxlen=CANDIDATES)
            else:
                del self._recent[key]
