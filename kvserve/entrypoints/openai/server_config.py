"""The server's own options (the engine's are EngineConfig): a module of its own so the route
modules can read them without importing the server that includes them."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.options import option as _opt


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = _opt(8000, "port to listen on")
    api_key: str | tuple[str, ...] | None = _opt(
        None, "require 'Authorization: Bearer KEY' on every route but /health; several keys "
        "(repeated or comma-separated) are tenants that never share prefix-cache blocks",
        multiple=True)
    served_model_name: str | None = _opt(None, "model name clients use (default: the model's)")
    max_waiting_requests: int = _opt(1024, "reject new requests with 503 beyond this many "
                                     "unfinished ones")
    max_request_body_bytes: int = _opt(16 * 2**20, "larger request bodies get 413")
    shutdown_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on SIGTERM")
    disable_log_requests: bool = _opt(False, "do not log each request")
    enable_auto_tool_choice: bool = _opt(True, "let the model decide whether to call the "
                                         "offered tools (tool_choice \"auto\", the default "
                                         "with tools); --no-enable-auto-tool-choice: 400")
    tool_call_parser: str = _opt("auto", "the model's tool-call format: hermes "
                                 "(<tool_call> JSON, also kvserve's default tool prompt), "
                                 "llama3_json, or auto (from the chat template)",
                                 choices=("auto", "hermes", "llama3_json"))
    reasoning_parser: str | None = _opt(
        None, "how the model's replies split into reasoning and answer (reasoning_content, "
        "reasoning items): deepseek_r1 or qwen3 (<think>...</think>), gpt_oss (harmony, also "
        "chosen without the flag where the chat template writes it); unset: the thinking "
        "stays in the content", choices=("deepseek_r1", "qwen3", "gpt_oss"))
    max_stored_responses: int = _opt(1000, "responses /v1/responses keeps in memory (least "
                                     "recently used out first) for previous_response_id and "
                                     "GET /v1/responses/{id}; 0 keeps none")
    lora_modules: tuple[str, ...] | None = _opt(
        None, "LoRA adapters (PEFT directories) served from the start, each name=path or "
        "vLLM's JSON {\"name\": ..., \"path\": ...} (space-separated, repeatable or "
        "comma-separated); requests name them as their model. Needs --enable-lora; more "
        "load at run time with POST /v1/load_lora_adapter", multiple=True, nargs="+")
    restart_engine_on_failure: bool = _opt(False, "when the engine core dies (crash, kill, "
                                           "OOM kill), fail its requests and start a new core "
                                           "instead of exiting non-zero")
    max_engine_restarts: int = _opt(3, "with --restart-engine-on-failure: restarts allowed "
                                    "before the server gives up and exits non-zero")
    webui: bool = _opt(True, "serve the web page (a streaming chat and a live dashboard) at /; "
                       "it loads without the API key and sends the key the user enters with "
                       "each call; --no-webui: / is a 404")
