"""How fast can speculative decoding make the code-edit scenario (s7) on this machine? Measures
what a verification step costs by its size, then replays the model's own greedy s7 answers
through each proposer three ways: verification free (tokens per step: the proposer's limit),
an oracle that drafts exactly as many tokens as will be accepted (the limit of any draft-length
policy, at this machine's step costs), and the engine's own policy (Drafter with the measured
curve). The speed-up is s7's: median TPOT without drafts over median TPOT with them. Writes
benchmarks/results/<cpu>/<date>-spec-ceiling.{md,json}.

Step costs: one sequence over a ~300-token cached context, k forced drafts a step (the tokens
it just produced), each size timed over several steps, sizes interleaved over rounds and the
median kept (this VM's speed drifts by 10-20% over minutes).

Usage: .venv/bin/python benchmarks/spec_ceiling.py [--max-drafts 16] [--rounds 5]
       [--save FILE | --load FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench import workloads
from kvserve.bench.machine import cpu_label, machine_header
from kvserve.bench.results import write_dated_result
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.cost import StepCostModel
from kvserve.spec_decode.drafter import Drafter, _room

RESULTS = Path(__file__).parent / "results"
# the proposers as benchmarks/run.py serves them (kvserve-ngram, kvserve-suffix)
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # longer drafts than the match (SuffixDecoding's max_spec_factor), up to 16
    "suffix-16": {"method": "suffix", "num_speculative_tokens": 16,
                  "suffix_decoding_max_spec_factor": 4.0},
}
CONTEXT_TOKENS = 300
WARM_STEPS, TIMED_STEPS = 3, 12


class _Forced:
    """Proposes the request's last k tokens (or none): a verification of k drafts."""

    def __init__(self):
        self.k = 0

    def propose(self, request_id, tokens, num_prompt_tokens):
        return list(tokens[-self.k:]) if self.k else []

    def finish(self, request_id):
        pass


def step_costs(llm: LLM, forced: _Forced, max_drafts: int, rounds: int) -> dict[int, float]:
    """Median seconds of a step verifying k drafts (k + 1 tokens), by k + 1."""
    engine = llm.llm_engine
    pattern = [100 + j for j in range(37)]
    prompt = (pattern * (CONTEXT_TOKENS // len(pattern) + 1))[:CONTEXT_TOKENS]
    times: dict[int, list[float]] = {}
    params = SamplingParams(max_tokens=(WARM_STEPS + TIMED_STEPS + 2) * (max_drafts + 1),
                            ignore_eos=True, temperature=0)
    for round_index in range(rounds):
        for k in range(max_drafts + 1):
            forced.k = 0
            request_id = f"cost-{round_index}-{k}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            engine.step()  # the prefill (prefix-cached after the first)
            forced.k = k
            for _ in range(WARM_STEPS):
                engine.step()
            start = time.perf_counter()
            for _ in range(TIMED_STEPS):
                engine.step()
            times.setdefault(k + 1, []).append((time.perf_counter() - start) / TIMED_STEPS)
            engine.abort_request([request_id])
            while engine.has_unfinished_requests():
                engine.step()
    return {size: statistics.median(values) for size, values in times.items()}


@dataclass
class Replay:
    """One request's greedy answer and its prompt's token ids."""

    prompt: list[int]
    answer: list[int]


@dataclass
class Outcome:
    steps: int = 0
    tokens: int = 0
    seconds_per_token: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds_per_token.append(seconds / tokens)


def _accepted(drafts: list[int], answer: list[int], emitted: int) -> int:
    count = 0
    while count < len(drafts) and emitted + count < len(answer) and \
            drafts[count] == answer[emitted + count]:
        count += 1
    return count


def replay(replays: list[Replay], proposer_config: dict, costs: dict[int, float],
           policy: str) -> Outcome:
    """Each answer emitted step by step, as the engine would with these drafts: `free` and
    `oracle` draft the proposer's whole proposal (free verification pays a 1-token step, the
    oracle pays for the accepted part only), `engine` drafts what the Drafter allocates on
    this cost curve and pays for all of it."""
    config = SpeculativeConfig(**proposer_config)
    curve = StepCostModel(costs)
    outcome = Outcome()
    drafter = Drafter(config, curve)
    for index, item in enumerate(replays):
        request = _Request(str(index), item)
        seconds = 0.0
        while request.num_output_tokens < len(item.answer):
            emitted = request.num_output_tokens
            if policy == "engine":
                drafter.propose([request], 1)
                drafts = request.spec_token_ids
            else:
                drafts = drafter.proposer.propose(request.request_id, request.all_token_ids,
                                                  request.num_prompt_tokens)[:_room(request)]
            accepted = _accepted(drafts, item.answer, emitted)
            if policy == "engine":
                drafter.observe(request.request_id, len(drafts), accepted)
            paid = {"free": 0, "oracle": accepted}.get(policy, len(drafts))
            seconds += curve.cost(1 + paid)
            outcome.steps += 1
            outcome.drafted += len(drafts)
            outcome.accepted += accepted
            request.all_token_ids.extend(item.answer[emitted:emitted + accepted + 1])
            request.num_output_tokens += accepted + 1
        drafter.finish(request.request_id)
        outcome.tokens += len(item.answer) - 1
        outcome.add(seconds, len(item.answer) - 1)
    return outcome


class _Request(SimpleNamespace):
    """What the Drafter reads of a running request, over a replayed answer."""

    __hash__ = object.__hash__

    def __init__(self, request_id: str, item: Replay):
        super().__init__(request_id=request_id, all_token_ids=item.prompt + item.answer[:1],
                         num_prompt_tokens=len(item.prompt), output_token_ids=None,
                         max_tokens=len(item.answer), num_output_tokens=1,
                         sampling_params=SimpleNamespace(structured_outputs=None),
                         spec_token_ids=[])

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-drafts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--name", default="spec-ceiling", help="result files' name")
    parser.add_argument("--save", type=Path, help="also write the step costs and the greedy "
                        "answers here (JSON), for --load")
    parser.add_argument("--load", type=Path, help="replay the step costs and answers a --save "
                        "wrote instead of measuring them (seconds: for trying a draft policy)")
    args = parser.parse_args()
    if args.load:
        saved = json.loads(args.load.read_text())
        costs = {int(size): seconds for size, seconds in saved["costs"].items()}
        replays = [Replay(item["prompt"], item["answer"]) for item in saved["replays"]]
    else:
        costs, replays = measure(args)
    if args.save:
        args.save.write_text(json.dumps({"costs": costs, "replays": [
            {"prompt": item.prompt, "answer": item.answer} for item in replays]}))
    rows = [{"costs_ms": {size: round(seconds * 1e3, 3) for size, seconds in costs.items()}}]
    for name, proposer_config in PROPOSERS.items():
        for policy in ("free", "oracle", "engine"):
            outcome = replay(replays, proposer_config, costs, policy)
            rows.append({"proposer": name, "policy": policy,
                         "tokens_per_step": outcome.tokens / outcome.steps,
                         "speedup": _speedup(costs, outcome),
                         "drafted": outcome.drafted, "accepted": outcome.accepted})
            print(rows[-1], flush=True)
    if not args.load:
        _write(rows, costs, args)


def measure(args) -> tuple[dict[int, float], list[Replay]]:
    """The step costs by size, then the model's greedy answers to s7's prompts."""
    forced = _Forced()
    llm = LLM(engine_core="thread", speculative_config={
        "method": "ngram", "num_speculative_tokens": args.max_drafts, "adaptive": False})
    llm.llm_engine.engine_core.drafter.proposer = forced
    costs = step_costs(llm, forced, args.max_drafts, args.rounds)
    forced.k = 0
    tokenizer = llm.get_tokenizer()
    specs = workloads.code_edit_workload(workloads.TextSource(tokenizer, 0), args.num_prompts,
                                         256, 128)  # s7's prompts
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    outputs = llm.generate([spec.prompt for spec in specs], params, use_tqdm=False)
    replays = [Replay(tokenizer.encode(spec.prompt, add_special_tokens=False),
                      list(output.outputs[0].token_ids))
               for spec, output in zip(specs, outputs)]
    llm.shutdown()
    return costs, replays


def _speedup(costs: dict[int, float], outcome: Outcome) -> float:
    """s7's TPOT ratio: one token a step without drafts over the median request's time per
    token with them (free verification pays a 1-token step for each step: the median
    request's tokens per step)."""
    return costs[1] / statistics.median(outcome.seconds_per_token)


def _write(rows: list[dict], costs: dict[int, float], args) -> None:
    header = machine_header()
    base = costs[1]
    lines = ["# Speculative decoding's ceiling on the code-edit scenario (s7)", "",
             f"CPU: {cpu_label(header)}. torch {torch.__version__}. Defaults (the dtype and "
             f"quantization this CPU gets). {args.num_prompts} s7 prompts, greedy answers of "
             "128 tokens, replayed. `benchmarks/spec_ceiling.py`.", "",
             "Step cost by tokens verified (one sequence, ~300 cached tokens; median of "
             f"{args.rounds} rounds of {TIMED_STEPS} steps):", "",
             "| tokens | " + " | ".join(str(size) for size in costs) + " |",
             "|---|" + "---|" * len(costs),
             "| ms | " + " | ".join(f"{seconds * 1e3:.2f}" for seconds in costs.values()) + " |",
             "| x 1 token | " + " | ".join(f"{seconds / base:.2f}" for seconds in costs.values())
             + " |", "",
             "Speed-up of s7's median TPOT over no drafts (free verification: the median "
             "request's tokens per step):", "",
             "| proposer | policy | tokens per step | speed-up | drafted | accepted |",
             "|---|---|---|---|---|---|"]
    for row in rows[1:]:
        lines.append(f"| {row['proposer']} | {row['policy']} | {row['tokens_per_step']:.2f} | "
                     f"{row['speedup']:.2f}x | {row['drafted']} | {row['accepted']} |")
    print(write_dated_result(RESULTS, header, args.name, rows, lines).read_text())


if __name__ == "__main__":
    main()
