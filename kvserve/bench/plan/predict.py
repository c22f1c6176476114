"""Predicted latency and throughput of one deployment candidate, from the roofline (bytes and
FLOPs per token) on a hardware profile plus the engine's overheads.

One engine instance spans tp x pp devices. A decode step at batch b reads the weights once
(a mixture: the experts its b tokens touch) and each sequence's KV, and does b tokens' FLOPs:
its time is the larger of the memory and compute times, plus the TP all-reduces, plus the
engine's fixed and per-sequence costs. A prefill is compute time plus a fixed and a per-token
overhead.
Arrivals: "steady" spreads them, so a prefill waits only for those queued ahead (M/D/1) and
the prefills of the others share the decode steps. "burst" is one wave: b requests arrive
together and the i-th waits for i prefills. "closed" is a closed loop of b clients with fixed
lengths (what `kvserve bench serve --max-concurrency b` runs), replayed step by step
(simulate.py; P/D keeps its formula): its clients fall into lockstep, which neither formula
sees."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.bench.plan.cost import PlanCost, attention_flops_per_token, \
    expected_experts_touched
from kvserve.bench.plan.hardware import Hardware
from kvserve.config import ModelConfig

MAX_NUM_SEQS = 256  # the engine's default max_num_seqs: the batch one instance runs at most


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    prefix_share: float = 0.0  # fraction of each prompt already cached (shared prefix)
    arrival: str = "steady"  # "steady", "burst" or "closed"
    requests: int = 0  # "closed": requests of the run per instance (0: 8 per client)

    @property
    def new_prompt_tokens(self) -> int:
        return max(1, round(self.input_len * (1.0 - self.prefix_share)))

    @property
    def mean_context(self) -> float:
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ((self.ttft_ms is None or ttft_s * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_s * 1e3 <= self.tpot_ms))


@dataclass(frozen=True)
class Candidate:
    """A deployment: `instances` engines of tp x pp devices each, aggregated (replicas, the
    router or Ray Serve in front) or disaggregated (prefill_instances of them prefill, the rest
    decode); weights in `quantization`, KV in `kv_dtype`. `share`: the fraction of one
    device's resources each instance gets (1: own devices; 1/2: two engines on one CPU)."""
    tp: int
    pp: int
    instances: int
    mode: str  # "aggregated" or "disaggregated"
    quantization: str
    kv_dtype: str
    prefill_instances: int = 0
    share: float = 1.0
    dp_attention: bool = False  # MLA + MoE: attention data-parallel, experts split (EP)

    @property
    def devices(self) -> int:
        return max(1, round(self.tp * self.pp * self.instances * self.share))

    @property
    def decode_instances(self) -> int:
        return self.instances - self.prefill_instances

    def label(self) -> str:
        layout = (f"DP{self.tp}-attn EP{self.tp}" if self.dp_attention else f"TP{self.tp}") \
            + (f" PP{self.pp}" if self.pp > 1 else "")
        if self.mode == "disaggregated":
            return f"{self.prefill_instances}P{self.decode_instances}D x {layout}"
        return f"{self.instances} x {layout}" if self.instances > 1 else layout


@dataclass(frozen=True)
class StepTimes:
    memory_s: float
    compute_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        parts = {"bandwidth": self.memory_s, "compute": self.compute_s,
                 "interconnect": self.comm_s, "engine overhead": self.overhead_s}
        return max(parts, key=parts.get)


class InstanceModel:
    """One engine instance of a candidate on a hardware profile."""

    def __init__(self, config: ModelConfig, cost: PlanCost, hardware: Hardware,
                 candidate: Candidate, compute_dtype: str):
        self.config, self.cost, self.hw, self.cand = config, cost, hardware, candidate
        share = candidate.share
        # token latency crosses the pp stages one after another: tp devices' rates at a time
        self.bandwidth = hardware.memory_gbps * 1e9 * hardware.bandwidth_efficiency \
            * candidate.tp * share
        self.flops = hardware.gflops[compute_dtype] * 1e9 * hardware.flops_efficiency \
            * candidate.tp * share
        # MLA's one latent row serves every head: each TP rank keeps (and reads) all of it,
        # unless attention is data-parallel (each rank its own sequences, SGLang's DP
        # attention), which instead keeps every weight but the routed experts on each rank
        self.kv_replication = candidate.tp if config.kv_lora_rank and \
            not candidate.dp_attention else 1
        self.weight_replication = candidate.tp if candidate.dp_attention else 1
        self.overheads = hardware.overheads(candidate.quantization, candidate.kv_dtype)

    def _routed_bytes(self, experts: float) -> float:
        return self.cost.moe_layers * self.cost.expert_bytes_per_layer * experts

    def weight_bytes_read(self, tokens: float) -> float:
        """Weights one step of `tokens` tokens reads over the instance's devices: a mixture's
        routed experts as touched; what DP attention replicates, once per device."""
        config = self.config
        routed_at_k = self._routed_bytes(config.num_experts_per_tok)
        routed = self._routed_bytes(expected_experts_touched(config, tokens))
        return (self.cost.cost.weight_bytes - routed_at_k) * self.weight_replication + routed

    def resident_bytes_per_device(self) -> float:
        routed = self._routed_bytes(self.config.num_experts)
        devices = self.cand.tp * self.cand.pp
        return ((self.cost.resident_weight_bytes - routed) * self.weight_replication
                + routed) / devices

    def _allreduce_s(self, tokens: float) -> float:
        """TP: two all-reduces a layer of tokens x hidden bf16 activations over a ring. DP
        attention: each MoE layer's dispatch and combine, every token's hidden to its k experts
        (all but 1/tp of them on other ranks), each rank sending its share of the tokens."""
        tp, hidden = self.cand.tp, self.config.hidden_size
        if tp == 1:
            return 0.0
        link = self.hw.interconnect_gbps * 1e9
        if self.cand.dp_attention:
            sent = tokens / tp * self.config.num_experts_per_tok * hidden * 2 * (tp - 1) / tp
            return 2 * self.cost.moe_layers * (self.hw.collective_latency_s + sent / link)
        ring = 2.0 * (tp - 1) / tp * tokens * hidden * 2
        return 2 * self.config.num_hidden_layers * (self.hw.collective_latency_s + ring / link)

    def _pipeline_s(self, tokens: float) -> float:
        hops = self.cand.pp - 1
        within_node = self.cand.tp * self.cand.pp <= self.hw.devices_per_node
        link = self.hw.interconnect_gbps if within_node and self.hw.interconnect_gbps \
            else self.hw.network_gbps
        return hops * (self.hw.collective_latency_s
                       + tokens * self.config.hidden_size * 2 / (link * 1e9))

    def decode_step(self, batch: int, context: float) -> StepTimes:
        cost = self.cost
        kv = batch * cost.kv_bytes_per_sequence(int(context)) * self.kv_replication
        flops = batch * (cost.cost.layer_flops_per_token + cost.cost.lm_head_flops_per_token
                         + attention_flops_per_token(self.config, int(context)))
        return StepTimes(
            memory_s=(self.weight_bytes_read(batch) + kv) / self.bandwidth,
            compute_s=flops / self.flops,
            comm_s=self._allreduce_s(batch) + self._pipeline_s(batch),
            overhead_s=self.overheads.step_s + batch * self.overheads.seq_s)

    def prefill(self, new_tokens: int, prompt_len: int) -> StepTimes:
        """One prompt's prefill of `new_tokens` (the rest cached): its tokens' FLOPs, and
        the attention over the whole prompt so far."""
        mean_context = prompt_len - new_tokens / 2
        flops = new_tokens * (self.cost.cost.layer_flops_per_token
                              + attention_flops_per_token(self.config, int(mean_context))) \
            + self.cost.cost.lm_head_flops_per_token
        return StepTimes(
            memory_s=self.weight_bytes_read(new_tokens) / self.bandwidth,
            compute_s=flops / self.flops,
            comm_s=self._allreduce_s(new_tokens) + self._pipeline_s(new_tokens),
            overhead_s=self._overhead_s(0, new_tokens))

    def mixed_step(self, decodes: int, prompt_tokens: int, context: float,
                   prompt_len: int) -> StepTimes:
        """One engine step of `decodes` sequences at mean `context` beside `prompt_tokens`
        tokens of prompts `prompt_len` long: the weights read once for all of its tokens,
        each decode's KV, every token's FLOPs, and the overheads of both kinds of work."""
        cost, tokens = self.cost, decodes + prompt_tokens
        kv = decodes * cost.kv_bytes_per_sequence(int(context)) * self.kv_replication
        flops = decodes * (cost.cost.layer_flops_per_token + cost.cost.lm_head_flops_per_token
                           + attention_flops_per_token(self.config, int(context))) \
            + prompt_tokens * (cost.cost.layer_flops_per_token
                               + attention_flops_per_token(self.config, prompt_len // 2))
        return StepTimes(
            memory_s=(self.weight_bytes_read(tokens) + kv) / self.bandwidth,
            compute_s=flops / self.flops,
            comm_s=self._allreduce_s(tokens) + self._pipeline_s(tokens),
            overhead_s=self._overhead_s(decodes, prompt_tokens))

    def _overhead_s(self, decodes: int, prompt_tokens: int) -> float:
        """A step's overheads: fixed, per decode, and (with prompt tokens) the prefill's
        fixed part and its per-token part."""
        o = self.overheads
        prefill = o.prefill_step_s + prompt_tokens * o.prefill_token_s if prompt_tokens else 0.0
        return o.step_s + decodes * o.seq_s + prefill

    def kv_transfer_s(self, tokens: int) -> float:
        """A prompt's KV from a prefill to a decode instance: over the node's interconnect,
        or through shared memory (memory bandwidth) on one CPU."""
        link = self.hw.interconnect_gbps or self.hw.memory_gbps
        return self.cost.kv_bytes_per_sequence(tokens) * self.kv_replication / (link * 1e9)


def compute_dtype(hardware: Hardware, quantization: str) -> str:
    """The GEMM rate a format runs at: fp8 (W8A8) at the fp8 rate where the device has one;
    weight-only formats dequantize to bf16; a CPU without native bf16 at float32."""
    if quantization == "fp8" and "fp8" in hardware.gflops:
        return "fp8"
    return "bfloat16" if "bfloat16" in hardware.gflops else "float32"


@dataclass(frozen=True)
class Latency:
    ttft_s: float
    tpot_s: float
    throughput: float  # output tokens/s of the whole deployment
    bound: str  # what dominates the decode step


def aggregated(model: InstanceModel, workload: Workload, batch: int,
               max_num_seqs: int = MAX_NUM_SEQS) -> Latency:
    """`batch` sequences per instance, prefills sharing the steps with decodes (at most
    `max_num_seqs` of them running in the closed loop's simulation)."""
    step = model.decode_step(batch, workload.mean_context)
    if workload.arrival == "closed":
        return _closed_loop(model, workload, batch, step.bound, max_num_seqs)
    prefill = model.prefill(workload.new_prompt_tokens, workload.input_len).total_s
    out = workload.output_len
    cycle = out * step.total_s + batch * prefill  # each sequence's life: decode plus prefills
    if workload.arrival == "burst":
        ttft = (batch + 1) / 2 * prefill
        tpot = step.total_s + (batch - 1) / 2 * prefill / out
    else:
        utilization = min(0.99, batch * prefill / cycle)
        ttft = prefill + _queue_s(utilization, prefill, batch - 1) + step.total_s / 2
        tpot = cycle / out
    ttft += model.overheads.request_s
    pipeline = model.cand.pp  # pp micro-batches in flight at the same token latency
    throughput = model.cand.instances * pipeline * batch * out / cycle
    return Latency(ttft, tpot, throughput, step.bound)


def _closed_loop(model: InstanceModel, workload: Workload, batch: int, bound: str,
                 max_num_seqs: int) -> Latency:
    """`batch` clients per instance replayed step by step (simulate.py); the instances
    (replicas) each run their own loop. The API server's per-request path is not added: a
    client's TTFT runs from its previous request's last token, and the simulation already
    schedules the new request one step late for its way back to the engine."""
    from kvserve.bench.plan.simulate import LoopShape, closed_loop

    prompt = workload.new_prompt_tokens

    def step_s(decodes: int, prompt_tokens: int, context: float) -> float:
        return model.mixed_step(decodes, prompt_tokens, context, workload.input_len).total_s

    shape = LoopShape(batch, workload.requests or 8 * batch, prompt, workload.output_len,
                      model.hw.step_tokens, max_num_seqs)
    loop = closed_loop(step_s, shape)
    return Latency(loop.ttft_s, loop.tpot_s,
                   model.cand.instances * model.cand.pp * loop.throughput, bound)


def disaggregated(prefill_model: InstanceModel, decode_model: InstanceModel,
                  workload: Workload, batch: int, max_num_seqs: int = MAX_NUM_SEQS) -> Latency:
    """`batch` sequences per decode instance; prefills on their own instances, each prompt's
    KV then moved to a decode instance (the decode's first step makes the first token;
    `max_num_seqs` of them running in the closed loop's simulation)."""
    cand = decode_model.cand
    step = decode_model.decode_step(batch, workload.mean_context)
    if workload.arrival == "closed":
        return _disaggregated_loop(prefill_model, decode_model, workload, batch, step.bound,
                                   max_num_seqs)
    prefill = prefill_model.prefill(workload.new_prompt_tokens, workload.input_len).total_s
    decode_rate = cand.decode_instances * cand.pp * batch / (workload.output_len * step.total_s)
    prefill_rate = cand.prefill_instances / prefill
    rate = min(decode_rate, prefill_rate)  # requests/s
    transfer = prefill_model.kv_transfer_s(workload.input_len)
    clients = cand.decode_instances * cand.pp * batch
    ahead = (clients - 1) / cand.prefill_instances  # at most, per prefill instance
    if workload.arrival == "burst":
        queue = (ahead + 2) / 2 * prefill
    else:
        utilization = min(0.99, rate * prefill / cand.prefill_instances)
        queue = prefill + _queue_s(utilization, prefill, ahead)
    ttft = queue + transfer + decode_model.overheads.handoff_s + step.total_s \
        + decode_model.overheads.request_s
    # Little's law: the clients in the system bound the rate too
    rate = min(rate, clients / (ttft + (workload.output_len - 1) * step.total_s))
    return Latency(ttft, step.total_s, rate * workload.output_len, step.bound)


def _disaggregated_loop(prefill_model: InstanceModel, decode_model: InstanceModel,
                        workload: Workload, batch: int, bound: str,
                        max_num_seqs: int) -> Latency:
    """`batch` clients per decode instance, replayed on a prefill and a decode instance
    (simulate.py's disaggregated_loop; xPyD gives each decode instance x/y of a prefill one):
    a closed loop spaces its clients out, where a queueing formula would see a prefill server
    near saturation queue them."""
    from kvserve.bench.plan.simulate import LoopShape, SplitCosts, disaggregated_loop

    cand, prompt = decode_model.cand, workload.new_prompt_tokens
    # xPyD: each decode instance's prompts get x/y of a prefill instance
    sharing = cand.decode_instances / max(1, cand.prefill_instances)
    costs = SplitCosts(
        prefill=lambda tokens: sharing * prefill_model.mixed_step(
            0, tokens, 0.0, workload.input_len).total_s,
        decode=lambda seqs, context: decode_model.decode_step(seqs, context).total_s,
        transfer_s=prefill_model.kv_transfer_s(workload.input_len)
        + decode_model.overheads.handoff_s)
    shape = LoopShape(batch, workload.requests or 8 * batch, prompt, workload.output_len,
                      prefill_model.hw.step_tokens, max_num_seqs)
    loop = disaggregated_loop(costs, shape)
    return Latency(loop.ttft_s, loop.tpot_s, cand.decode_instances * cand.pp * loop.throughput,
                   bound)


def _queue_s(utilization: float, service_s: float, most_ahead: float) -> float:
    """Waiting before a prefill: M/D/1's mean, but never more than the requests that can be
    ahead of it (B concurrent sequences: B - 1)."""
    return min(utilization * service_s / (2 * (1 - utilization)),
               max(0.0, most_ahead) * service_s)


def candidate_dict(candidate: Candidate) -> dict:
    return dict(asdict(candidate), label=candidate.label(), devices=candidate.devices)
