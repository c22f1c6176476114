"""The front-end's half of a request: the core's token deltas become user-visible outputs
(incremental text, stop strings, logprobs, timing) and n > 1 samples are grouped back into one
RequestOutput.

Stop strings are matched on text, so they live here rather than in the core; a match finishes
the sample here and the front-end tells the core to drop it. While a request runs, the last
(longest stop string - 1) characters are held back so a stop string is never half-emitted.

Each output is built as the request's `output_kind` asks: the whole sample so far (CUMULATIVE),
what is new since its previous output (DELTA: what a stream forwards, at a cost per step that
does not grow with the answer), or nothing until it finishes (FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.request import RequestTimes
from kvserve.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from kvserve.protocol.engine_core import EngineCoreOutput
from kvserve.protocol.worker import TokenLogprobs
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.tokenizer import Tokenizer


class SampleState:
    """Tokens, text and logprobs of one sample (one single-sample request in the core), built
    from the core's deltas."""

    def __init__(self, request_id: str, group_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer, arrival_time: float):
        self.request_id = request_id
        self.group_id = group_id
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens, prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.text = ""
        self.stop_strings = params.stop or []
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # vLLM's shape: None for the first prompt token, then one dict per prompt token
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_logprobs_emitted = False  # a DELTA output carries them once
        self.stopped_by_string: str | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1
        self.num_transferred_tokens = 0
        self.kv_transfer_params = None  # the handle a prefill engine's last output carries
        self.num_preemptions = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding
        self.pooling_output: list[float] | None = None  # a pooling request's vector
        self.times = RequestTimes(arrival=arrival_time)
        # DELTA outputs: how much text and how many tokens earlier outputs carried
        self.text_emitted = self.tokens_emitted = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_delta(self, delta: EngineCoreOutput, now: float) -> bool:
        """Apply one step's delta from the core. True if a stop string just finished the sample
        here, in the front-end (the core still runs it until it hears so)."""
        if delta.first_scheduled_time is not None:
            self.times.first_scheduled = delta.first_scheduled_time
        if delta.num_cached_tokens >= 0:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.num_transferred_tokens:
            self.num_transferred_tokens = delta.num_transferred_tokens
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        self.num_preemptions = delta.num_preemptions
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [self._logprob_dict(entry)
                                             for entry in delta.prompt_logprobs]
        if delta.pooling_output is not None:
            self.pooling_output = delta.pooling_output
        self.num_draft_tokens += delta.num_draft_tokens
        self.num_accepted_tokens += delta.num_accepted_tokens
        logprobs = delta.new_logprobs or [None] * len(delta.new_token_ids)
        for token_id, token_logprobs in zip(delta.new_token_ids, logprobs):
            self.output_token_ids.append(token_id)
            if self.add_token(token_id, token_logprobs) is not None:
                break  # a stop string ends the sample here: later tokens of the delta are not its
        if delta.new_token_ids:
            if self.times.first_token is None:
                self.times.first_token = now
            self.times.last_token = now
        if self.stopped_by_string is not None:
            # a stop string found on the last allowed token still ends the sample with "stop"
            self._finish("stop", self.stopped_by_string, now)
            return delta.finish_reason is None
        if delta.finish_reason is not None:
            self._finish(delta.finish_reason, delta.stop_reason, now)
        return False

    def _finish(self, reason: str, stop_reason: int | str | None, now: float) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.times.finished = now

    def abort(self, now: float) -> None:
        if not self.finished:
            self._finish("abort", None, now)

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
        """Append a token's text and logprobs; returns the stop string it completed, if any."""
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
                keep = self.params.include_stop_str_in_output
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

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs for this output: every output carries them once they arrived,
        except DELTA outputs, where only the first does."""
        if self.params.output_kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_emitted:
                return None
            self.prompt_logprobs_emitted = self.prompt_logprobs is not None
        return self.prompt_logprobs

    def output(self) -> CompletionOutput:
        """The sample as its output kind asks: all of it so far, or (DELTA) what is new since
        the previous call. Text inside the stop-string holdback is not shown yet."""
        visible_end = len(self.text) if self.finished or not self.stop_strings else \
            max(0, len(self.text) - self.holdback)
        text_start = token_start = 0
        if self.params.output_kind == RequestOutputKind.DELTA:
            text_start, token_start = self.text_emitted, self.tokens_emitted
            self.text_emitted = max(text_start, visible_end)
            self.tokens_emitted = len(self.output_token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.text[text_start:visible_end],
            token_ids=self.output_token_ids[token_start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[token_start:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )


@dataclass(frozen=True)
class StepProgress:
    """Where one user request stands after a step, whatever its outputs carry: what the
    server's token metrics count (DELTA and FINAL_ONLY outputs hold no running totals)."""

    request_id: str
    num_output_tokens: int
    time_to_first_token: float | None
    finished: bool


@dataclass
class RequestGroup:
    """A user request: one SampleState per sample (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)
    pooling: bool = False  # a pooling request: one PoolingRequestOutput when it finishes

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def progress(self) -> StepProgress:
        first = _earliest(s.times.first_token for s in self.samples)
        return StepProgress(self.request_id, sum(len(s.output_token_ids) for s in self.samples),
                            None if first is None else first - self.samples[0].times.arrival,
                            self.finished)

    def output(self) -> RequestOutput | PoolingRequestOutput | None:
        """This step's output; None for a FINAL_ONLY request that has not finished."""
        samples = self.samples
        if samples[0].params.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.pooling:
            return self._pooling_output()
        cached = max(0, samples[0].num_cached_tokens)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=cached,
            metrics=_group_metrics(samples),
            num_transferred_tokens=samples[0].num_transferred_tokens,
            kv_transfer_params=samples[0].kv_transfer_params,
            prompt_logprobs=samples[0].take_prompt_logprobs(),
        )


    def _pooling_output(self) -> PoolingRequestOutput:
        """vLLM's PoolingRequestOutput (its vector empty for a request aborted before its
        prompt was done)."""
        sample = self.samples[0]
        vector = sample.pooling_output if sample.pooling_output is not None else []
        return PoolingRequestOutput(
            request_id=self.request_id, outputs=PoolingOutput(vector),
            prompt_token_ids=self.prompt_token_ids,
            num_cached_tokens=max(0, sample.num_cached_tokens), finished=self.finished,
            metrics=_group_metrics(self.samples))


def _earliest(values):
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _latest(values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _group_metrics(samples: list[SampleState]) -> RequestMetrics:
    times = [s.times for s in samples]
    finished = [t.finished for t in times]
    return RequestMetrics(
        arrival_time=times[0].arrival,
        first_scheduled_time=_earliest(t.first_scheduled for t in times),
        first_token_time=_earliest(t.first_token for t in times),
        last_token_time=_latest(t.last_token for t in times),
        finished_time=max(finished) if all(f is not None for f in finished) else None,
        num_preemptions=sum(s.num_preemptions for s in samples),
    )
