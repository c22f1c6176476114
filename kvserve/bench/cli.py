"""`kvserve bench {serve,offline,perplexity,roofline,kernels}` argument parsing and drivers."""

from __future__ import annotations

import asyncio
import json
import time

from kvserve.bench import machine, report, server_metrics, workloads
from kvserve.bench.stats import SLO, describe, summarize


SESSION_WORKLOADS = ("multi-turn", "agentic", "agent-sessions")


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: serve, offline, perplexity, "
                                "roofline, kernels")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default="smollm2-135m-instruct",
                       help="model name sent to the server")
    serve.add_argument("--tokenizer", default="smollm2-135m-instruct",
                       help="kvserve model reference whose tokenizer cuts the prompts")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--workload", default="random",
                       choices=["random", "shared-prefix", "multi-turn", "long-prompt",
                                "code-edit", "agentic", "agent-sessions"],
                       help="agent-sessions: --num-prompts sessions of --turns turns, each "
                       "turn asked only after every session answered its previous one")
    serve.add_argument("--num-prompts", type=int, default=64,
                       help="requests (multi-turn: sessions)")
    serve.add_argument("--max-concurrency", default=None,
                       help="max requests in flight; a comma list (1,8,32) sweeps and plots "
                       "throughput against it")
    serve.add_argument("--request-rate", type=float, default=None,
                       help="Poisson arrivals per second (default: all at once)")
    serve.add_argument("--input-len", type=int, default=256)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--range-ratio", type=float, default=0.0)
    serve.add_argument("--prefix-len", type=int, default=1024)
    serve.add_argument("--long-len", type=int, default=2048, help="long-prompt: long length")
    serve.add_argument("--turns", type=int, default=6, help="multi-turn: turns per session")
    serve.add_argument("--system-prompt-len", type=int, default=0,
                       help="multi-turn: a system prompt of this many tokens opens every "
                       "session (shared prefix; routers: try 256 with >= 16 sessions)")
    serve.add_argument("--metrics-url", action="append", default=None,
                       help="server whose prefix-cache counters (/metrics) the report adds up "
                       "(repeat; default: the base URL, or a router's replicas)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="sent in every request body (default 0: greedy)")
    serve.add_argument("--top-p", type=float, default=None,
                       help="sent in every request body when given")
    serve.add_argument("--extra-body", type=json.loads, default=None,
                       help="JSON merged into every request body, as vLLM's bench serve has it "
                       '(e.g. \'{"structured_outputs": {"json": {...}}}\')')
    serve.add_argument("--slo-ttft-ms", type=float, default=None)
    serve.add_argument("--slo-tpot-ms", type=float, default=None)
    serve.add_argument("--slo-e2e-ms", type=float, default=None)
    serve.add_argument("--label", default="kvserve", help="system name in the report")
    serve.add_argument("--output-json", default=None)
    serve.add_argument("--plot", default=None, help="directory for latency CDF plots")
    serve.add_argument("--no-progress", action="store_true")

    offline = kinds.add_parser("offline", help="throughput/latency of the LLM API, no HTTP")
    offline.add_argument("--model", default="smollm2-135m-instruct")
    offline.add_argument("--dtype", default="auto")
    offline.add_argument("--num-prompts", type=int, default=64)
    offline.add_argument("--input-len", type=int, default=256)
    offline.add_argument("--output-len", type=int, default=128)
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--output-json", default=None)

    ppl = kinds.add_parser("perplexity", help="perplexity on held-out stdlib documentation")
    ppl.add_argument("--model", default="smollm2-135m-instruct")
    ppl.add_argument("--dtype", default="auto")
    ppl.add_argument("--quantization", default="none")
    ppl.add_argument("--kv-cache-dtype", default="auto",
                     choices=["auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3"],
                     help="K/V storage (auto: the engine's choice for --dtype)")
    ppl.add_argument("--window", type=int, default=512)
    ppl.add_argument("--max-windows", type=int, default=None)
    ppl.add_argument("--chunk", type=int, default=None,
                     help="tokens per step of one window, so decode-sized kernels score it "
                     "(w4a8's integer dot products run only on few-row steps); default: each "
                     "window in one prefill step")
    ppl.add_argument("--output-json", default=None)

    roof = kinds.add_parser("roofline", help="this machine's bandwidth and GEMM rates, and the "
                            "model's decode and prefill roofs")
    roof.add_argument("--model", default="smollm2-135m-instruct")
    roof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                      help="the model's dtype (auto: the engine's on this CPU, bfloat16 only "
                      "with native bf16)")
    roof.add_argument("--quantization", default="auto",
                      choices=["auto", "none", "int4", "int8", "w8a8", "w4a8", "fp8"],
                      help="weight format whose bytes a decode step reads (auto: as the engine)")
    roof.add_argument("--output-json", default=None)

    kernels = kinds.add_parser("kernels", help="kernel ISA level, CPU, autotune table, and "
                               "F.linear at one row on SmolLM2's shapes")
    kernels.add_argument("--output-json", default=None)


def run_bench(args) -> int:
    commands = {"serve": _serve, "offline": _offline, "roofline": _roofline,
                "perplexity": _perplexity, "kernels": _kernels}
    return commands[args.bench_command](args)


def _tokenizer(reference: str):
    from kvserve.model_source import resolve_model
    from kvserve.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(reference))


def _build_workload(args, source: workloads.TextSource):
    if args.workload == "random":
        return workloads.random_workload(source, args.num_prompts, args.input_len,
                                         args.output_len, args.range_ratio)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix_workload(source, args.num_prompts, args.prefix_len,
                                                args.input_len, args.output_len)
    if args.workload == "code-edit":
        return workloads.code_edit_workload(source, args.num_prompts, args.input_len,
                                            args.output_len)
    if args.workload == "long-prompt":
        return workloads.long_prompt_workload(source, args.num_prompts, args.input_len,
                                              args.output_len, args.long_len)
    if args.workload == "agent-sessions":
        return workloads.agent_sessions_workload(source, args.num_prompts, args.turns,
                                                 args.input_len, args.output_len,
                                                 args.system_prompt_len)
    if args.workload == "agentic":
        return workloads.agentic_workload(source, args.num_prompts, args.turns, args.input_len,
                                          args.output_len)
    return workloads.multi_turn_workload(source, args.num_prompts, args.turns, args.input_len,
                                         args.output_len, args.system_prompt_len)


async def _drive(args, specs):
    from kvserve.bench.client import (
        BenchClient,
        run_requests,
        run_sessions,
        run_sessions_interleaved,
    )

    client = BenchClient(args.base_url, args.model, args.api_key,
                         temperature=args.temperature, top_p=args.top_p,
                         extra_body=args.extra_body)
    try:
        start = client.now()
        if args.workload == "agent-sessions":
            results = await run_sessions_interleaved(client, specs, args.max_concurrency,
                                                     not args.no_progress)
        elif args.workload in ("multi-turn", "agentic"):
            results = await run_sessions(client, specs, args.max_concurrency,
                                         not args.no_progress)
        else:
            results = await run_requests(client, specs, args.max_concurrency, args.request_rate,
                                         args.seed, not args.no_progress)
        return results, client.now() - start
    finally:
        await client.close()


def _serve(args) -> int:
    levels = [int(c) for c in str(args.max_concurrency).split(",")] \
        if args.max_concurrency else [None]
    if len(levels) == 1:
        args.max_concurrency = levels[0]
        return _serve_once(args)
    points, failed = [], 0
    base_json = args.output_json
    for level in levels:
        args.max_concurrency = level
        if base_json:
            args.output_json = base_json.replace(".json", f"-c{level}.json")
        failed += _serve_once(args)
        points.append((level, json.loads(open(args.output_json).read())["summary"][
            "output_throughput"]) if args.output_json else (level, float("nan")))
    if args.plot:
        report.plot_throughput_vs_concurrency({args.label: points}, args.plot)
    return 1 if failed else 0


def _serve_once(args) -> int:
    source = workloads.TextSource(_tokenizer(args.tokenizer), args.seed)
    specs = _build_workload(args, source)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls, router = server_metrics.metrics_urls(args.base_url, args.metrics_url, headers)
    before = server_metrics.read(args.base_url, urls, router, headers)
    results, duration = asyncio.run(_drive(args, specs))
    counted = server_metrics.run_delta(before, server_metrics.read(args.base_url, urls, router,
                                                                    headers))
    slo = None
    if any(v is not None for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)):
        slo = SLO(*(None if v is None else v / 1000
                    for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)))
    summary = summarize(results, duration, slo)
    summary["server"] = counted
    if args.workload in SESSION_WORKLOADS:  # turns a prefix cache can help
        summary["ttft_later_turns_s"] = describe(
            [r.ttft for r in results if r.ok and r.turn and r.ttft is not None])
    row = {"system": args.label, "scenario": args.workload, "machine": machine.machine_header(),
           "summary": summary,
           "config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
           "errors": sorted({r.error for r in results if r.error})[:5],
           "per_request": [{"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e,
                            "output_tokens": r.output_tokens, "error": r.error,
                            # agent sessions: runs with and without KV tiers are compared
                            # token for token (greedy)
                            **({"turn": r.turn, "output_text": r.output_text}
                               if args.workload == "agent-sessions" else {})}
                           for r in results]}
    print(report.markdown_table([row]))
    print(server_metrics.describe(counted, urls))
    if summary["failed"]:
        print(f"{summary['failed']} requests failed, e.g. {row['errors'][:2]}")
    if args.output_json:
        report.write_json(args.output_json, row)
    if args.plot:
        report.plot_latency_cdfs({args.label: results}, args.plot)
    return 0 if not summary["failed"] else 1


def _offline(args) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype)
    source = workloads.TextSource(llm.get_tokenizer(), args.seed)
    specs = workloads.random_workload(source, args.num_prompts, args.input_len, args.output_len)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(s.prompt, False)[:args.input_len]}
               for s in specs]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = sorted(o.metrics.time_to_first_token for o in outputs)
    result = {"requests": len(outputs), "seconds": seconds,
              "output_throughput": generated / seconds,
              "total_token_throughput": (generated + prompt_tokens) / seconds,
              "ttft_p50_s": ttfts[len(ttfts) // 2], "dtype": llm.llm_engine.core_ready.dtype,
              "quantization": llm.llm_engine.core_ready.quantization}
    print(json.dumps(result, indent=1))
    if args.output_json:
        report.write_json(args.output_json, result)
    return 0


def _perplexity(args) -> int:
    from kvserve.bench.perplexity import held_out_text, perplexity
    from kvserve.kernels.reference import kv_dtype_name
    from kvserve.model_source import resolve_model
    from kvserve.models.loader import load_model, resolve_dtype
    from kvserve.platform import default_dtype, kv_cache_dtype
    from kvserve.tokenizer import load_tokenizer

    source = resolve_model(args.model)
    dtype = default_dtype("cpu") if args.dtype == "auto" else resolve_dtype(args.dtype)
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype, args.dtype == "auto", "cpu")
    model, _ = load_model(source, dtype, attention_backend="paged",
                          quantization=args.quantization)
    tokens = load_tokenizer(source).encode(held_out_text(), add_special_tokens=False)
    result = {"model": source.name, "dtype": str(dtype),
              "kv_cache_dtype": kv_dtype_name(kv_dtype),
              "quantization": args.quantization,
              "chunk": args.chunk,
              **perplexity(model, tokens, args.window, max_windows=args.max_windows,
                           kv_dtype=kv_dtype, chunk=args.chunk)}
    print(json.dumps(result, indent=1))
    if args.output_json:
        report.write_json(args.output_json, result)
    return 0


def _roofline(args) -> int:
    from kvserve.bench import roofline  # torch: only this command measures with it
    from kvserve.model_source import resolve_model
    from kvserve.models import load_config

    config = load_config(resolve_model(args.model))
    fmt = roofline.resolve_format(config, args.dtype, args.quantization)
    roof = roofline.measure_roof(config)
    payload = roofline.roof_payload(roof, config, fmt, machine.machine_header())
    print("\n".join(roofline.roof_summary(payload)))
    if args.output_json:
        report.write_json(args.output_json, payload)
    return 0


def _kernels(args) -> int:
    from kvserve.bench import kernels

    result = kernels.kernels_report()
    kernels.print_kernels_report(result)
    if args.output_json:
        report.write_json(args.output_json, {"machine": machine.machine_header(), **result})
    return 0
