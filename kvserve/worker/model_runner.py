"""ModelRunner: a step's scheduled requests -> one flattened ragged batch -> forward -> sampled tokens.

The only part of the engine that touches tensors and device memory (the KV cache lives here).
Logits are computed just for the rows that sample. On a pipeline stage (`parallel` with pp_size
> 1) it receives the previous stage's hidden states before its layers and sends its own to the
next stage after them; only the last stage samples.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.attention import build_attention_metadata
from kvserve.attention.kv_tensors import allocate_kv_caches
from kvserve.distributed.communication import recv_from_prev_stage, send_to_next_stage
from kvserve.distributed.parallel_state import ParallelContext
from kvserve.models.layers.decoder import IntermediateTensors
from kvserve.protocol.worker import ModelRunnerOutput
from kvserve.sample.logits_processor import LogitsProcessor
from kvserve.sample.prompt_logprobs import score_prompt_rows
from kvserve.sample.sampler import Sampler, SamplerOutput, SamplingRow, SpecSamplerOutput
from kvserve.spec_decode.proposal import ForwardView
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.request_state import RunnerInput, ScheduledItem
from kvserve.worker.streaming import StreamingKV


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str = "cpu",
                 seed: int = 0, kv_dtype: torch.dtype | None = None,
                 parallel: ParallelContext | None = None, samples: bool = True,
                 logits_processors: Sequence[LogitsProcessor] = (),
                 placement: tuple[list[int], list[int]] = ([], []),
                 streaming_sink_blocks: int | None = None):
        """`samples`: False on ranks whose samples nobody reads (tensor ranks other than the
        output rank: they join the logits gather, then stop). `logits_processors`: custom
        ones, for the sampler. `placement`: the hybrid KV layout's group and tensor of each
        layer (kv_cache/spec.py `layer_placement`; empty: one group, a tensor per layer).
        `streaming_sink_blocks`: attention sinks on (EngineConfig.streaming_sink_blocks)."""
        self.model = model
        self.samples = samples
        self.config = model.config
        self.block_size = block_size
        self.streaming = None if streaming_sink_blocks is None else \
            StreamingKV(model, block_size, streaming_sink_blocks)
        self.device = torch.device(device)
        kv_dtype = kv_dtype or next(model.parameters()).dtype
        layer_groups, layer_tensors = placement
        layouts = model.kv_page_layouts(kv_dtype)  # each layer's, as it declares it
        if layer_groups:  # hybrid: one tensor per index within a group, shared by the groups
            shared = [layouts[layer_tensors.index(t)] for t in range(max(layer_tensors) + 1)]
            self.kv_caches = allocate_kv_caches(shared, num_blocks, block_size, device)
            model.bind_kv_cache([self.kv_caches[t] for t in layer_tensors], layer_groups)
        else:
            self.kv_caches = allocate_kv_caches(layouts, num_blocks, block_size, device)
            model.bind_kv_cache(self.kv_caches)
        self.stage = parallel if parallel is not None and parallel.pp_size > 1 else None
        if self.stage is not None:
            self._intermediate_count = 1 if model.kernel_ops is None else 2  # eager: no residual
            self._activation_dtype = model.activation_dtype
        ops = model.kernel_ops
        self.sampler = Sampler(seed, ops, logits_processors)
        self.input_batch = InputBatch(emits_updates=samples)
        self._generators: dict[str, torch.Generator] = {}
        # a proposer that reads the target's hidden states (MTP) asks each step's forward to
        # be kept until it has drafted (`last_forward`)
        self.keep_forward = False
        self.last_forward: ForwardView | None = None

    @torch.inference_mode()
    def execute(self, scheduler_output: RunnerInput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_ids:
            self._generators.pop(request_id, None)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput.empty()
        query_lens = [s.num_new_tokens for s in scheduled]
        if self.streaming is None:
            tables, starts = [s.block_ids for s in scheduled], [s.start_position for s in scheduled]
        else:  # attention sinks: tables without evicted positions, positions within the cache
            tables, starts = zip(*(self.streaming.view(s.request, s.block_ids, s.start_position)
                                   for s in scheduled))
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        metadata, positions = build_attention_metadata(
            query_lens, seq_lens, list(tables), self.block_size, self.device)
        if scheduled[0].request.group_block_ids:  # hybrid: each group's tables and slots
            metadata.group_metadata = [
                build_attention_metadata(query_lens, seq_lens, [s.tables[g] for s in scheduled],
                                         self.block_size, self.device)[0]
                for g in range(1, len(scheduled[0].tables))]
        input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.long,
                                 device=self.device)
        if getattr(self.model, "lora", None) is not None:
            self._set_lora_rows(scheduled, metadata.query_start_loc_host)
        if self.stage is None:
            hidden = self.model(input_ids, positions, metadata)
        else:
            hidden = self._run_stage(input_ids, positions, metadata)
            if hidden is None:
                return ModelRunnerOutput.empty()
        if self.keep_forward:
            self.last_forward = ForwardView(scheduled, positions, metadata, hidden)
        ends = metadata.query_start_loc_host
        output = self._sample(scheduled, hidden, ends)
        output.prompt_logprobs = self._prompt_logprobs(scheduled, hidden, ends)
        output.pooler_output = self._pool(scheduled, hidden, ends)
        return output

    def _sample(self, scheduled: list[ScheduledItem], hidden: torch.Tensor,
                ends: list[int]) -> ModelRunnerOutput:
        """The step's sampled tokens (or verified drafts), from logits of only the rows that
        sample."""
        sampling = [s for s in scheduled if s.sample and s.request.pooler is None]
        if not sampling:
            return ModelRunnerOutput.empty()
        batch_update, rows = self._batch_rows(scheduled, sampling)
        sampling = [scheduled[i] for i in rows]
        # each sampling row's last token, and before it its drafts' positions (to verify)
        logits_index = torch.tensor([position for i in rows for position in range(
            ends[i + 1] - 1 - scheduled[i].num_draft_tokens, ends[i + 1])], device=self.device)
        logits = self.model.compute_logits(hidden[logits_index])
        if not self.samples:
            return ModelRunnerOutput.empty()
        sampling_rows = [self._sampling_row(s) for s in sampling]
        if len(logits_index) > len(rows):
            result = self.sampler.verify(logits, sampling_rows,
                                         [s.draft_token_ids for s in sampling], batch_update)
            self.input_batch.applied()
            return self._package_verified(sampling, result)
        result = self.sampler(logits, sampling_rows, batch_update)
        self.input_batch.applied()
        return self._package(sampling, result)

    def _set_lora_rows(self, scheduled: list[ScheduledItem], ends: list[int]) -> None:
        """Which of the step's token rows run which LoRA adapter (the base: none)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for i, item in enumerate(scheduled):
            if item.request.lora_id:
                spans.setdefault(item.request.lora_id, []).append((ends[i], ends[i + 1]))
        self.model.lora.set_rows(spans, ends[-1])

    def _prompt_logprobs(self, scheduled: list[ScheduledItem], hidden: torch.Tensor,
                         ends: list[int]) -> dict[str, tuple[int, list]]:
        """Prompt logprobs for the prompt positions this step computed of requests that asked:
        position p scores prompt token p + 1 (the last prompt position's logits are the first
        sample's, whose logprobs are the sample's own)."""
        scored = {}
        for i, item in enumerate(scheduled):
            request = item.request
            num_top = request.sampling_params.prompt_logprobs
            last = len(request.prompt_token_ids) - 1  # the last position that scores a token
            if num_top is None or item.start_position >= last:
                continue
            stop = min(item.start_position + item.num_new_tokens, last)
            rows = hidden[ends[i]:ends[i] + stop - item.start_position]
            targets = request.prompt_token_ids[item.start_position + 1:stop + 1]
            entries = score_prompt_rows(self.model.compute_logits, rows, targets, num_top,
                                        keep=self.samples)
            if self.samples:
                scored[request.request_id] = (item.start_position, entries)
        return scored

    def _pool(self, scheduled: list[ScheduledItem], hidden: torch.Tensor,
              ends: list[int]) -> dict[str, list[float]]:
        """Each pooling request's chunk goes into its pooler; those whose prompt this step
        completed (`sample`: the chunk reaches its end) get their vector. Only on the rank
        whose outputs the core reads."""
        pooled = {}
        for i, item in enumerate(scheduled):
            pooler = item.request.pooler
            if pooler is None or not self.samples:
                continue
            pooler.add_chunk(item.start_position, hidden[ends[i]:ends[i + 1]])
            if item.sample:
                pooled[item.request.request_id] = pooler.result()
        return pooled

    def _batch_rows(self, scheduled: list[ScheduledItem], sampling: list[ScheduledItem]):
        """The persistent batch's changes, and its rows' indices into `scheduled`: logits rows
        come in the batch's order, which keeps each request's logits-processor state on one
        row."""
        batch_update = self.input_batch.update([s.request for s in sampling])
        position = {s.request: i for i, s in enumerate(scheduled)}
        return batch_update, [position[request] for request in self.input_batch.requests]

    def _run_stage(self, input_ids, positions, metadata) -> torch.Tensor | None:
        """This stage's layers between the previous stage's hidden states and the next's;
        the final hidden states on the last stage, None elsewhere."""
        stage = self.stage
        intermediate = None
        if not stage.is_first_stage:
            packed = torch.empty(self._intermediate_count, input_ids.shape[0],
                                 self.config.hidden_size, dtype=self._activation_dtype,
                                 device=self.device)
            recv_from_prev_stage(packed, stage)
            intermediate = IntermediateTensors.unpack(packed)
        out = self.model(input_ids, positions, metadata, intermediate)
        if stage.is_last_stage:
            return out
        send_to_next_stage(out.pack(), stage)
        return None

    def _sampling_row(self, item: ScheduledItem) -> SamplingRow:
        request = item.request
        return SamplingRow(
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=self._generator(request.request_id, request.sampling_params.seed),
        )

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(seed)
        return self._generators[request_id]

    @staticmethod
    def _package_verified(sampling: list[ScheduledItem],
                          result: SpecSamplerOutput) -> ModelRunnerOutput:
        """Each row's emitted tokens, and how many of its drafts' positions were rejected
        (their KV is not kept: the scheduler steps back past them)."""
        ids = [s.request.request_id for s in sampling]
        return ModelRunnerOutput(
            dict(zip(ids, result.token_ids)),
            {rid: lps for rid, lps in zip(ids, result.logprobs) if lps is not None},
            num_rejected_tokens={rid: s.num_draft_tokens - (len(tokens) - 1)
                                 for rid, s, tokens in zip(ids, sampling, result.token_ids)})

    @staticmethod
    def _package(sampling: list[ScheduledItem], result: SamplerOutput) -> ModelRunnerOutput:
        ids = [s.request.request_id for s in sampling]
        logprobs = {rid: [lp] for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return ModelRunnerOutput({rid: [token] for rid, token in zip(ids, result.token_ids)},
                                 logprobs)
