"""Where does an engine step's time go? Runs decode steps at a batch size under torch.profiler
and prints the top ops, plus the wall time split between model forward, sampling and the rest.

Usage: .venv/bin/python benchmarks/profile_step.py [--batch 1] [--context 256] [--steps 20]
  --per-op: wall time per projection kind, attention and LM head (torch.profiler does not see
  the C++ kernels, which are plain bindings); implies --no-profile and --enforce-eager (the
  decode stack runs the layers in C++, out of the timers' reach)
  --prefill: time prompt steps instead: each step prefills a fresh prompt of --context tokens
  (random ids, one request; --batch is ignored)
"""

from __future__ import annotations

import argparse
import collections
import time
from contextlib import nullcontext

from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: sample with top_p 0.9 (the sampler's own cost shows)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="paged")
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-profile: plain wall times, no profiler overhead")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the decoder layers from Python, op by op (no decode stack)")
    parser.add_argument("--prefill", action="store_true",
                        help="time fresh --context-token prompts (one a step) instead of decodes")
    parser.add_argument("--per-op", action="store_true",
                        help="time each projection kind, attention and the LM head")
    args = parser.parse_args()
    if args.per_op:
        args.profile, args.enforce_eager = False, True

    extra = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.model:
        extra["model"] = args.model
    llm = LLM(dtype=args.dtype, attention_backend=args.attention_backend,
              cpu_kernels=args.cpu_kernels, engine_core="thread",
              enforce_eager=args.enforce_eager, **extra)
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, top_p=0.9 if args.temperature else 1.0,
                            max_tokens=args.steps + 10, ignore_eos=True)
    if args.prefill:
        args.batch = 0
        params.max_tokens = 1
    for i in range(args.batch):
        prompt = [(i * 31 + j) % 40000 + 100 for j in range(args.context)]
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running) \
            or engine.engine_core.scheduler.waiting:
        engine.step()
    runner = engine.engine_core.runner
    timings = {"forward+sample": 0.0, "step": 0.0}
    original = runner.execute

    def timed_execute(output):
        start = time.perf_counter()
        result = original(output)
        timings["forward+sample"] += time.perf_counter() - start
        return result

    runner.execute = timed_execute
    op_times = _time_ops(runner.model) if args.per_op else None
    if op_times is not None:
        _time_sampler(runner, op_times)
    with profile(activities=[ProfilerActivity.CPU]) if args.profile else nullcontext() as prof:
        start = time.perf_counter()
        for step in range(args.steps):
            if args.prefill:  # a fresh prompt (no prefix hits), prefilled by this step
                prompt = [(step * 7919 + j * 31) % 40000 + 100 for j in range(args.context)]
                engine.add_request(f"prefill{step}", {"prompt_token_ids": prompt}, params)
            engine.step()
        timings["step"] = time.perf_counter() - start
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    per_step = timings["step"] / args.steps * 1000
    runner_ms = timings["forward+sample"] / args.steps * 1000
    shape = f"prefill of {args.context} tokens" if args.prefill else \
        f"batch {args.batch}, context {args.context}"
    print(f"{shape}: {per_step:.2f} ms/step "
          f"({per_step / max(args.batch, 1):.2f} ms/token); runner {runner_ms:.2f} ms, "
          f"scheduler+output processing {per_step - runner_ms:.2f} ms"
          + (" (profiled, so slower)" if args.profile else ""))
    for name, (seconds, calls) in sorted((op_times or {}).items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:16s} {seconds / args.steps * 1000:7.3f} ms/step  "
              f"{calls / args.steps:5.1f} calls/step  {seconds / max(calls, 1) * 1e6:8.1f} us/call")
    engine.abort_request([f"p{i}" for i in range(args.batch)])


def _time_ops(model) -> dict[str, list]:
    """Wrap the projections (by kind), attention, the whole forward and the LM head with wall
    timers: name -> [seconds, calls]."""
    totals = collections.defaultdict(lambda: [0.0, 0])

    def wrap(obj, attribute: str, name: str) -> None:
        inner = getattr(obj, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += 1
            return result

        setattr(obj, attribute, timed)

    for layer in model.model.stage_layers:
        attention, mlp = layer.self_attn, layer.mlp
        for module, name in ((attention.qkv_proj, "qkv"), (attention.o_proj, "o"),
                             (mlp.gate_up_proj, "gate_up"), (mlp.down_proj, "down")):
            wrap(module, "forward", name)
    wrap(model.model.layer_ops.backend, "attend", "attention")
    wrap(model, "forward", "model.forward")
    wrap(model, "compute_logits", "lm head")
    return totals


def _time_sampler(runner, totals) -> None:
    """Wall time of the sampler (temperature, top-p, the draw or argmax) per step."""
    sampler = runner.sampler

    class TimedSampler:
        def __call__(self, *args, **kwargs):
            start = time.perf_counter()
            result = sampler(*args, **kwargs)
            totals["sampler"][0] += time.perf_counter() - start
            totals["sampler"][1] += 1
            return result

        def __getattr__(self, name):
            return getattr(sampler, name)

    runner.sampler = TimedSampler()


if __name__ == "__main__":
    main()
