"""How likely a context draft is to be accepted, by the length of the match it continues.

A context proposer (prompt lookup, suffix) drafts what followed an earlier occurrence of the
sequence's last L tokens. The longer that match, the likelier the text goes on copying: replaying
SmolLM2's greedy answers to the code-edit prompts (s7) through the suffix proposer, a draft
token continuing a match of 2 tokens was right 49% of the time, of 4 81%, of 6-11 ~88%, of 12
or more ~95%. A draft's j-th token continues a match of L + j (if the tokens before it were
right), so the chance that the first j are all right is the product of the rates at L .. L+j-1.

One running estimate per request (the drafter's fallback) averages these: in a long copied run
it reads ~0.8 and cuts drafts short where the run goes on (the largest loss against an oracle
policy in that replay). Here the rates are counted per length over every request, starting from
a prior of 1 - 1/L (what the replay measured, to within its noise) worth PRIOR_WEIGHT
observations, so a new engine drafts sensibly from its first request and then learns the
workload's own rates."""

from __future__ import annotations

MAX_LENGTH = 32  # longer matches share the last count
PRIOR_WEIGHT = 8.0


class MatchLengthAcceptance:
    def __init__(self):
        self.tried = [0] * (MAX_LENGTH + 1)
        self.accepted = [0] * (MAX_LENGTH + 1)

    def rate(self, length: int) -> float:
        """The chance a draft token continuing a match of `length` tokens is right."""
        length = min(max(length, 1), MAX_LENGTH)
        prior = 1.0 - 1.0 / max(length, 2)
        return (self.accepted[length] + PRIOR_WEIGHT * prior) / (self.tried[length]
                                                                  + PRIOR_WEIGHT)

    def gains(self, match_length: int, count: int) -> list[float]:
        """The chance that the first j + 1 of `count` drafts are all right, for each j."""
        gains, chance = [], 1.0
        for j in range(count):
            chance *= self.rate(match_length + j)
            gains.append(chance)
        return gains

    def observe(self, match_length: int, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: the accepted drafts and the first rejected one were tried
        (the ones after it say nothing)."""
        for j in range(min(num_drafts, num_accepted + 1)):
            length = min(max(match_length + j, 1), MAX_LENGTH)
            self.tried[length] += 1
            self.accepted[length] += j < num_accepted
