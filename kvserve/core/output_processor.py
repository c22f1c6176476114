"""Turns sampled tokens into user-visible outputs: incremental text, stop strings, logprobs,
and the grouping of n > 1 samples back into one RequestOutput.

Stop strings are matched on text, so they live here rather than in the scheduler; a match
finishes the request through the scheduler before its next step. While a request runs, the last
(longest stop string - 1) characters are held back so a stop string is never half-emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.request import Request
from kvserve.core.sampler import TokenLogprobs
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.tokenizer import Tokenizer


class SampleState:
    """Text and logprobs of one sample (one child request)."""

    def __init__(self, request: Request, group_id: str, index: int, tokenizer: Tokenizer):
        self.request = request
        self.group_id = group_id
        self.index = index
        self.tokenizer = tokenizer
        params = request.sampling_params
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens,
                                                 request.prompt_token_ids)
        self.text = ""
        self.stop_strings = params.stop or []
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.stopped_by_string: str | None = None

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
        """Append a token; returns the stop string it completed, if any."""
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(self._logprob_dict(logprobs))
            self.cumulative_logprob += logprobs.logprob
        if self.stopped_by_string is not None:
            return None
        delta = self.detokenizer.add(token_id)
        if not delta:
            return None
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        for stop in self.stop_strings:
            position = self.text.find(stop, search_from)
            if position != -1:
                keep = self.request.sampling_params.include_stop_str_in_output
                self.text = self.text[: position + (len(stop) if keep else 0)]
                self.stopped_by_string = stop
                return stop
        return None

    def _logprob_dict(self, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entries = {logprobs.token_id: Logprob(logprobs.logprob, logprobs.rank,
                                              decode([logprobs.token_id], False))}
        for rank, (token_id, value) in enumerate(logprobs.top, start=1):
            if token_id not in entries:
                entries[token_id] = Logprob(value, rank, decode([token_id], False))
        return entries

    def output(self) -> CompletionOutput:
        finished = self.request.is_finished
        visible = self.text if finished or not self.stop_strings else \
            self.text[: max(0, len(self.text) - self.holdback)]
        return CompletionOutput(
            index=self.index,
            text=visible,
            token_ids=list(self.request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            # a stop string found on the last allowed token still ends the sample with "stop"
            finish_reason="stop" if self.stopped_by_string is not None and finished
            else self.request.finish_reason(),
            stop_reason=self.stopped_by_string if self.stopped_by_string is not None
            else self.request.stop_reason,
        )


@dataclass
class RequestGroup:
    """A user request: one SampleState per sample (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def output(self) -> RequestOutput:
        requests = [s.request for s in self.samples]
        cached = max(0, requests[0].num_cached_tokens)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=cached,
            metrics=_group_metrics(requests),
        )


def _earliest(values):
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _latest(values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _group_metrics(requests: list[Request]) -> RequestMetrics:
    times = [r.times for r in requests]
    finished = [t.finished for t in times]
    return RequestMetrics(
        arrival_time=times[0].arrival,
        first_scheduled_time=_earliest(t.first_scheduled for t in times),
        first_token_time=_earliest(t.first_token for t in times),
        last_token_time=_latest(t.last_token for t in times),
        finished_time=max(finished) if all(f is not None for f in finished) else None,
        num_preemptions=sum(r.num_preemptions for r in requests),
    )
