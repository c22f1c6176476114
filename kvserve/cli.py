"""`kvserve` command: generate, chat, serve, run-batch, router, bench, plan."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.entrypoints.cli_args import (
    add_dataclass_args,
    add_engine_args,
    dataclass_from_args,
    engine_config_from_args,
)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args):
    from kvserve import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
                          stop=args.stop)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--log-level", default=None, help="default: INFO for serve, else WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete one prompt and print the text")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn")
    chat = commands.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system message")
    for sub in (generate, chat):
        add_engine_args(sub)
        _sampling_args(sub)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    from kvserve.entrypoints.openai.server import ServerConfig

    add_dataclass_args(serve, ServerConfig, "server")
    add_engine_args(serve)
    from kvserve.ray_serve.config import RayServeConfig

    add_dataclass_args(serve, RayServeConfig, "replicas (Ray Serve)")
    _run_batch_parser(commands)
    router = commands.add_parser("router", help="OpenAI-compatible router over several "
                                 "kvserve replicas (KV-aware placement from their KV events)")
    from kvserve.router.app import RouterConfig

    router.add_argument("--replica", action="append", default=[], dest="replicas",
                        metavar="URL", help="a replica's base URL, e.g. http://127.0.0.1:8000 "
                        "(repeat for each; kv-aware needs them started with "
                        "--kv-events-config)")
    router.add_argument("--prefill", action="append", default=[], dest="prefill_replicas",
                        metavar="URL", help="disaggregated mode: a prefill server (started "
                        "with --kv-role prefill; repeatable; needs --decode)")
    router.add_argument("--decode", action="append", default=[], dest="decode_replicas",
                        metavar="URL", help="disaggregated mode: a decode server (started "
                        "with --kv-role decode; repeatable; needs --prefill)")
    add_dataclass_args(router, RouterConfig, "router")
    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(commands)
    from kvserve.bench.plan.cli import add_plan_parser

    add_plan_parser(commands)
    from kvserve.bench.doctor import add_doctor_parser

    add_doctor_parser(commands)
    return parser


# the server's options that mean nothing without a socket (run-batch serves no one)
_SOCKET_ONLY_OPTIONS = ("host", "port", "api_key", "max_waiting_requests",
                        "max_request_body_bytes", "shutdown_timeout",
                        "restart_engine_on_failure", "max_engine_restarts", "webui")


def _run_batch_parser(commands) -> None:
    run_batch = commands.add_parser("run-batch", help="run an OpenAI batch file (JSONL) "
                                    "through the server's endpoints offline; resumable")
    from kvserve.entrypoints.openai.batch import RunBatchConfig
    from kvserve.entrypoints.openai.server import ServerConfig

    add_dataclass_args(run_batch, RunBatchConfig, "batch")
    add_dataclass_args(run_batch, ServerConfig, "endpoints", skip=_SOCKET_ONLY_OPTIONS)
    add_engine_args(run_batch)


def _run_batch(args) -> int:
    from kvserve.entrypoints.openai.batch import RunBatchConfig, run_batch
    from kvserve.entrypoints.openai.server import ServerConfig

    if not args.input_file or not args.output_file:
        print("error: run-batch needs -i/--input-file and -o/--output-file", file=sys.stderr)
        return 2
    return run_batch(engine_config_from_args(args), dataclass_from_args(ServerConfig, args),
                     dataclass_from_args(RunBatchConfig, args))


def _run_bench(args) -> int:
    from kvserve.bench.cli import run_bench

    return run_bench(args)


def _run_plan(args) -> int:
    from kvserve.bench.plan.cli import run_plan

    return run_plan(args)


def _run_doctor(args) -> int:
    from kvserve.bench.doctor import run_doctor

    return run_doctor(args)


def _run_serve(args) -> int:
    from kvserve.entrypoints.openai.server import ServerConfig, run_server

    from kvserve.ray_serve.config import RayServeConfig

    serve_config = dataclass_from_args(RayServeConfig, args)
    if serve_config.on_ray and args.lora_modules:
        print("error: --lora-modules is not served by --replicas yet (Ray Serve replicas); "
              "serve adapters from one replica", file=sys.stderr)
        return 2
    if serve_config.on_ray:  # engine replicas as Ray Serve deployments (kvserve/ray_serve/)
        from kvserve.ray_serve.app import run_replicas

        return run_replicas(engine_config_from_args(args), dataclass_from_args(ServerConfig, args),
                            serve_config)
    return run_server(engine_config_from_args(args), dataclass_from_args(ServerConfig, args))


def _stream(engine, request_id: str, prompt, params) -> str:
    """Run one request, printing text deltas as they arrive; returns the full text."""
    engine.add_request(request_id, prompt, params)
    printed = 0
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return text


def _run_router(args) -> int:
    from kvserve.router.app import RouterConfig, replica_roles, run_router

    try:
        replica_roles(args.replicas, args.prefill_replicas, args.decode_replicas)
    except ValueError as exc:  # which replicas, in what roles: the command line's error
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_router(dataclass_from_args(RouterConfig, args), args.replicas,
                      args.prefill_replicas, args.decode_replicas)


def _run_generate(args) -> int:
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    try:
        prompt = args.prompt
        if args.chat:
            prompt = engine.inputs.render_chat([{"role": "user", "content": prompt}])
        _stream(engine, "cli", prompt, _sampling_params(args))
    finally:
        # asks the core to stop; left to the exit-time finalizer, it would wait 5 s, then
        # terminate the core process
        engine.shutdown()
    return 0


def _run_chat(args) -> int:
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    try:
        _chat_loop(engine, args)
    finally:
        engine.shutdown()
    return 0


def _chat_loop(engine, args) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    print("kvserve chat: type a message, or Ctrl-D to quit.")
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        prompt = engine.inputs.render_chat(messages)
        reply = _stream(engine, f"chat-{turn}", prompt, _sampling_params(args))
        messages.append({"role": "assistant", "content": reply})
        turn += 1


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvserve.errors import KVServeError

    try:
        commands = {"generate": _run_generate, "chat": _run_chat, "serve": _run_serve,
                    "router": _run_router, "bench": _run_bench, "plan": _run_plan,
                    "doctor": _run_doctor, "run-batch": _run_batch}
        return commands[args.command](args)
    except KVServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
