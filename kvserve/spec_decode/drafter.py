"""The engine core's side of speculative decoding. The proposers run in the worker that samples
(spec_decode/proposers.py); the core decides what drafting pays and keeps the counters:

- before a step goes out, `limits`: how many drafts each request that samples in it may get
  afterwards, per the step-cost model (none at a batch where no draft can pay, so the worker's
  proposer skips its work; a draft model's count weighed against what its forwards cost);
- when the step's results land, `propose`: the worker's drafts for each request now in decode,
  joined with structured output's forced spans, cut to what pays for this batch given each
  request's acceptance estimate (`allocate_drafts`), become its `spec_token_ids`;
- after a verification, `observe`: what was accepted feeds the estimate and the engine's
  counters (vLLM's spec_decode metrics).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.cost import StepCostModel, a_draft_can_pay, allocate_drafts

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0  # the acceptance line in the engine log, at most this often
PRIOR_ACCEPTANCE = 0.5  # a request's per-draft acceptance before it has any history
# a grammar's forced spans, tokenized, are the model's own tokens ~90% of the time (measured on
# SmolLM2 JSON output); they keep an estimate of their own
PRIOR_FORCED_ACCEPTANCE = 0.9
ACCEPTANCE_SMOOTHING = 0.3  # weight of a step's outcome in a request's running estimate
# A request given no drafts learns nothing, so its estimate would stay where a run of misses
# left it (after ~6 missed single drafts, too low for any draft to pay). On the code-edit
# workload (s7) answers often open with lines of their own (new imports) before they copy, and
# with a frozen estimate 3 of 16 requests got no drafts for the rest of their answer. So after
# this many steps without drafts its estimate goes back to the prior (a retry). A retry whose
# drafts are all rejected sets it to zero at once and doubles the wait, up to RETRY_MAX_STEPS
# (a request whose drafts never match spends ~5 steps of 128 on retries); an accepted draft
# ends the backoff.
RETRY_FIRST_STEPS = 4
RETRY_MAX_STEPS = 64
# proposers whose every draft position costs a forward (the worker reports them): the draft
# count is decided before they run, priced with them
PRICED_METHODS = ("draft_model", "mtp")


@dataclass
class SpecDecodeStats:
    """Counters since start-up, as vLLM's metrics name them."""

    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Drafter:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None,
                 grammar=None):
        """`cost`: the target's step costs; `grammar`: structured output's drafts for
        constrained requests (structured_output/drafts.py: `drafts(request_id, spec, outputs,
        proposed)` and `finish(request_id)`), or None."""
        self.config = config
        self.cost = cost or StepCostModel()
        # a draft model's (MTP's) forwards, by tokens in the forward (the worker times them)
        self.draft_cost = StepCostModel()
        self.grammar = grammar
        # per-draft acceptance estimates, by request id (and (id, "forced") for forced spans)
        self.acceptance: dict[str | tuple[str, str], float] = {}
        self._estimate_of: dict[str, str | tuple[str, str]] = {}  # the last drafts' estimate
        # per estimate without drafts: [steps since its last drafts, steps to wait for a retry]
        self._retry: dict[str | tuple[str, str], list[int]] = {}
        self.stats = SpecDecodeStats(
            accepted_per_position=[0] * config.num_speculative_tokens)
        self._logged_at = time.monotonic()

    def limits(self, requests, base_tokens: int, base_reads: int = 0) -> dict[str, int]:
        """Drafts the worker may make for each of these requests (they sample in the step
        about to run, and decode next) for a next step of `base_tokens` tokens and
        `base_reads` attention reads besides drafts. Context drafts cost next to nothing to
        make: each may get them all, unless no draft could pay at this batch. A draft model's
        or MTP's forward per draft position is priced here, before it runs."""
        if not requests:
            return {}
        if self.config.method in PRICED_METHODS:
            return self._priced_limits(requests, base_tokens, base_reads)
        if self.config.adaptive and not self._any_constrained(requests) and not a_draft_can_pay(
                len(requests), base_tokens, self.cost, base_reads,
                min(request.num_tokens for request in requests)):
            return {}
        limits = {request.request_id: self._next_room(request) for request in requests}
        return {request_id: limit for request_id, limit in limits.items() if limit > 0}

    def _next_room(self, request) -> int:
        """Drafts the request can take after the step about to run (which emits at least one
        of its tokens)."""
        return min(self.config.num_speculative_tokens, _room(request) - 1)

    def _priced_limits(self, requests, base_tokens: int, base_reads: int) -> dict[str, int]:
        """Each request's draft count, decided before the proposer runs a forward per draft
        position (a draft model; MTP's head and modules): from the acceptance estimates and
        what a draft token costs to make and to verify."""
        room = {request: self._next_room(request) for request in requests}
        if not self.config.adaptive:
            counts = room
        else:
            gains = {request: [self._acceptance(request.request_id) ** (j + 1)
                               for j in range(max(0, limit))]
                     for request, limit in room.items()}
            counts = allocate_drafts(base_tokens, gains, self.cost,
                                     self._draft_token_seconds(len(requests)), base_reads,
                                     _draft_reads(requests))
        for request, limit in room.items():
            if limit > 0 and not counts[request]:
                self._recover(request.request_id)
        return {request.request_id: count for request, count in counts.items() if count > 0}

    def _draft_token_seconds(self, num_sequences: int) -> float:
        """What one more draft token costs when a draft forward carries `num_sequences`
        sequences (its share of the forward); free until a forward was timed (MTP's first
        drafts measure it; a draft model's are profiled when the worker starts)."""
        if not self.draft_cost.points():
            return 0.0
        num_sequences = max(1, num_sequences)
        return self.draft_cost.cost(num_sequences) / num_sequences

    def observe_forwards(self, forwards) -> None:
        """The drafting forwards the worker ran (a draft model's, MTP's), (tokens, seconds)
        each."""
        for tokens, seconds in forwards:
            self.draft_cost.observe(tokens, seconds)

    def propose(self, requests, base_tokens: int, base_reads: int = 0,
                proposals: dict[str, list[int]] | None = None) -> None:
        """Set `spec_token_ids` of these requests (running, in decode: every token but the
        last sampled one computed) for the next step, which runs `base_tokens` tokens and
        `base_reads` attention reads (cost.py) besides drafts, from the worker's
        `proposals` (made after the step that just landed), as many as pay."""
        proposals = proposals or {}
        kept = {}
        for request in requests:
            drafts = proposals.get(request.request_id, [])
            spec = request.sampling_params.structured_outputs
            forced = False
            if self.grammar is not None and spec is not None:
                drafts, forced = self.grammar.drafts(request.request_id, spec,
                                                     request.output_token_ids, drafts)
            self._estimate_of[request.request_id] = (
                (request.request_id, "forced") if forced else request.request_id)
            kept[request] = drafts[:_room(request)]
        if self.config.adaptive:
            gains = {request: [self._acceptance(request.request_id) ** (j + 1)
                               for j in range(len(drafts))]
                     for request, drafts in kept.items()}
            counts = allocate_drafts(base_tokens, gains, self.cost, base_reads=base_reads,
                                     draft_reads=_draft_reads(kept))
        else:
            counts = {request: len(drafts) for request, drafts in kept.items()}
        for request, drafts in kept.items():
            request.spec_token_ids = drafts[:counts[request]]
            if drafts and not request.spec_token_ids:
                self._recover(request.request_id)

    def _any_constrained(self, requests) -> bool:
        """Whether a request could get structured output's forced spans (judged by their own,
        higher prior, so they may pay where context drafts cannot). Only these keep the
        proposals going at a batch where no context draft pays: the engine always has the
        grammar drafts, and testing for them alone left the skip dead (suffix proposals, ~50
        us a request, ran on every step at 64 requests)."""
        return self.grammar is not None and any(
            request.sampling_params.structured_outputs is not None for request in requests)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: `num_accepted` of `num_drafts` drafts kept."""
        if num_drafts <= 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        # drafts tried: the accepted ones, and the first rejected one if any
        key = self._estimate_of.get(request_id, request_id)
        if num_accepted:
            self._retry.pop(key, None)
        if not num_accepted and key in self._retry:  # a retry that found nothing: wait again
            self.acceptance[key] = 0.0
        else:
            rate = num_accepted / min(num_drafts, num_accepted + 1)
            old = self._acceptance(request_id)
            self.acceptance[key] = old + ACCEPTANCE_SMOOTHING * (rate - old)
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            self._logged_at = time.monotonic()
            logger.info("speculative decoding (%s): %d of %d draft tokens accepted (%.0f%%), "
                        "%.2f per step with drafts; accepted by position %s", self.config.method,
                        stats.num_accepted_tokens, stats.num_draft_tokens,
                        100 * stats.acceptance_rate,
                        stats.num_accepted_tokens / stats.num_drafts,
                        stats.accepted_per_position)

    def _recover(self, request_id: str) -> None:
        """A step without drafts for a request that had some to offer: after its wait
        (RETRY_FIRST_STEPS, doubled by each fruitless retry) its estimate is the prior again."""
        key = self._estimate_of.get(request_id, request_id)
        if key not in self.acceptance:
            return
        retry = self._retry.setdefault(key, [0, RETRY_FIRST_STEPS])  # [idle steps, wait]
        retry[0] += 1
        if retry[0] >= retry[1]:
            del self.acceptance[key]
            retry[0], retry[1] = 0, min(2 * retry[1], RETRY_MAX_STEPS)

    def finish(self, request_id: str) -> None:
        if self.grammar is not None:
            self.grammar.finish(request_id)
        for key in (request_id, (request_id, "forced")):
            self.acceptance.pop(key, None)
            self._retry.pop(key, None)
        self._estimate_of.pop(request_id, None)

    def _acceptance(self, request_id: str) -> float:
        """The running estimate the request's current drafts are judged by."""
        key = self._estimate_of.get(request_id, request_id)
        return self.acceptance.get(key, _prior(key))


def _prior(key: str | tuple[str, str]) -> float:
    """The acceptance a request's drafts are judged by before any history (forced spans: their
    own)."""
    return PRIOR_FORCED_ACCEPTANCE if isinstance(key, tuple) else PRIOR_ACCEPTANCE


def _draft_reads(requests) -> dict:
    """The attention reads one draft of each request adds to a step: its context."""
    return {request: request.num_tokens for request in requests}


def _room(request) -> int:
    """Drafts that fit before max_tokens: a step emits its accepted drafts plus one token."""
    return max(0, request.max_tokens - request.num_output_tokens - 1)
