"""Markdown of a benchmarks/run.py run (machine and ISA level, configurations, the scenario table,
kvserve / peer ratios, fractions of the roof) and BENCHMARKS.md: the headline run of every CPU
found under benchmarks/results/, one section and table per CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvserve.bench.machine import cpu_label
from kvserve.bench.results import DEFAULT_MODEL, SavedRun
from kvserve.bench.roofline import MachineRoof, ModelCost, roof_fractions

SCENARIO_TEXT = (
    "Scenarios: s1 1 stream x 6, 256/128; s2 64 requests at concurrency 32, 256/128; s3 32 at "
    "concurrency 8 sharing a 1,024-token prefix, 64/32; s4 multi-turn, 8 sessions x 6 turns, "
    "128-token turns, 64-token answers; s5 = s2 sampled with temperature 0.8, top_p 0.95.")
# (column title, scenario, summary key, percentile or None, scale)
TABLE_COLUMNS = (
    ("s1 TPOT p50 ms", "s1", "tpot_s", "p50", 1000),
    ("s1 TTFT p50 ms", "s1", "ttft_s", "p50", 1000),
    ("s2 out tok/s", "s2", "output_throughput", None, 1),
    ("s2 TPOT p50 ms", "s2", "tpot_s", "p50", 1000),
    ("s3 TTFT p50 ms", "s3", "ttft_s", "p50", 1000),
    ("s3 out tok/s", "s3", "output_throughput", None, 1),
    ("s4 out tok/s", "s4", "output_throughput", None, 1),
    ("s4 TTFT p50 ms", "s4", "ttft_s", "p50", 1000),
    ("s5 out tok/s", "s5", "output_throughput", None, 1),
    ("s5 TPOT p50 ms", "s5", "tpot_s", "p50", 1000))
# the scenarios outside the standard set, shown where a run has them
EXTRA_COLUMNS = (
    ("s6 out tok/s", "s6", "output_throughput", None, 1),
    ("s6 E2E p50 ms", "s6", "e2e_s", "p50", 1000),
    ("s7 TPOT p50 ms", "s7", "tpot_s", "p50", 1000),
    ("s8 out tok/s", "s8", "output_throughput", None, 1),
    ("s8 TPOT p50 ms", "s8", "tpot_s", "p50", 1000),
    ("s9 TPOT p50 ms", "s9", "tpot_s", "p50", 1000),
    ("s9 out tok/s", "s9", "output_throughput", None, 1),
    ("s10 TPOT p50 ms", "s10", "tpot_s", "p50", 1000),
    ("s11 out tok/s", "s11", "output_throughput", None, 1),
    ("s12 out tok/s", "s12", "output_throughput", None, 1),
    ("s12 TPOT p50 ms", "s12", "tpot_s", "p50", 1000),
    ("s13 TPOT p50 ms", "s13", "tpot_s", "p50", 1000),
    ("s13 TTFT p50 ms", "s13", "ttft_s", "p50", 1000),
    ("s14 out tok/s", "s14", "output_throughput", None, 1),
    ("s14 TPOT p50 ms", "s14", "tpot_s", "p50", 1000))
RATIO_METRICS = (("s1", "tpot_s", "p50"), ("s1", "ttft_s", "p50"),
                 ("s2", "output_throughput", None), ("s3", "ttft_s", "p50"),
                 ("s3", "output_throughput", None), ("s4", "output_throughput", None),
                 ("s5", "output_throughput", None), ("s6", "output_throughput", None),
                 ("s7", "tpot_s", "p50"), ("s8", "output_throughput", None),
                 ("s9", "tpot_s", "p50"), ("s10", "tpot_s", "p50"),
                 ("s11", "output_throughput", None), ("s12", "output_throughput", None),
                 ("s13", "tpot_s", "p50"), ("s13", "ttft_s", "p50"),
                 ("s14", "output_throughput", None))
# structured output's scenarios -> the free-text scenario of the same shape
STRUCTURED = {"s10": "s1", "s11": "s2"}
# system-name endings of speculating variants
SPECULATING = ("-ngram", "-suffix", "-draft", "-mtp", "-mtp2")
# (column title, scenario, concurrency, prompt tokens, roof_fractions key); 128 outputs each
ROOF_COLUMNS = (("s1 decode", "s1", 1, 256, "output_fraction_of_roof"),
                ("s1 prefill", "s1", 1, 256, "single_prefill_fraction_of_roof"),
                ("s2 decode", "s2", 32, 256, "output_fraction_of_roof"),
                ("s5 decode", "s5", 32, 256, "output_fraction_of_roof"),
                ("s13 decode", "s13", 1, 512, "output_fraction_of_roof"),
                ("s13 prefill", "s13", 1, 512, "single_prefill_fraction_of_roof"),
                ("s14 decode", "s14", 16, 512, "output_fraction_of_roof"))


def _value(summary: dict, key: str, percentile: str | None) -> float:
    return summary[key][percentile] if percentile else summary[key]


def machine_line(header: dict, kernel_release: str, versions: dict) -> str:
    levels = ", ".join(header.get("machine_isa_levels") or [])
    return (f"Machine: {cpu_label(header)}, {header['arch']}, {header['cores']} cores, "
            f"{kernel_release}; the CPU's kernel ISA levels: {levels}; native bf16: "
            f"{'yes' if header.get('native_bf16') else 'no'}. Versions: {json.dumps(versions)}.")


def configuration_line(roof: dict | None, model: str = DEFAULT_MODEL) -> str:
    fmt = (roof or {}).get("weight_format") or {"dtype": "?", "quantization": "?"}
    isa_level = (roof or {}).get("cpu", {}).get("isa_level", "?")
    if model != DEFAULT_MODEL and Path(model).is_dir():
        return (f"Model: {model}, an HF directory every system served as it is. "
                f"Configurations: kvserve = defaults on this CPU ({fmt['dtype']}, "
                f"`--quantization auto` = {fmt['quantization']}; fused C++ CPU kernels built "
                f"for {isa_level}, paged attention).")
    if model != DEFAULT_MODEL:
        return (f"Model: {model}, its bundled GGUF for every system. Configurations: kvserve = "
                f"defaults on this CPU ({fmt['dtype']}, `--quantization auto` = "
                f"{fmt['quantization']}, weights taken from the GGUF's; fused C++ CPU kernels "
                f"built for {isa_level}, paged attention); kvserve-kv512m = a 512 MiB KV pool "
                "(-nohybrid: one block table for every layer, `--disable-hybrid-kv-cache-"
                "manager`); llama.cpp = the same GGUF, unified KV; vLLM-CPU = bf16 HF directory "
                "made from the GGUF.")
    return ("Configurations: kvserve = defaults on this CPU (" + fmt["dtype"] + ", "
            "`--quantization auto` = " + fmt["quantization"] + "; int4 = weights recovered "
            "exactly from the Q4_1 GGUF with an int8 LM head; w4a8 = the same weights with "
            "activations rounded to int8 per group of 32 and integer dot products; fused C++ CPU kernels built for "
            + isa_level + ", paged attention); kvserve-w8a8 = `--quantization w8a8` (int8 "
            "weights, int8 activations on batched steps; +4% perplexity); kvserve-bf16 = "
            "`--quantization none`; llama.cpp = the same Q4_1 GGUF, 32 slots, unified KV; "
            "vLLM-CPU = bf16 HF directory made from the GGUF.")


def scenario_table(records: list[dict]) -> list[str]:
    present = {scenario for record in records for scenario in record["scenarios"]}
    columns = TABLE_COLUMNS + tuple(c for c in EXTRA_COLUMNS if c[1] in present)
    titles = ["system", "cold start s"] + [column[0] for column in columns]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for record in records:
        cells = [record["system"], f"{record.get('cold_start_s', float('nan')):.1f}"]
        for _, scenario, key, percentile, scale in columns:
            summary = record["scenarios"].get(scenario)
            cells.append(f"{_value(summary, key, percentile) * scale:.1f}" if summary else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ratio_lines(records: list[dict]) -> list[str]:
    peers = [r for r in records if not r["system"].startswith("kvserve")]
    lines = []
    for ours in (r for r in records if r["system"].startswith("kvserve")):
        for peer in peers:
            lines.append(f"- {ours['system']} vs {peer['system']}: "
                         + "; ".join(_ratio_parts(ours, peer)))
    if not lines:
        return []
    return ["Ratios, kvserve / peer (throughput: higher is better for kvserve; latency: lower "
            "is better for kvserve):", ""] + lines


def _ratio_parts(ours: dict, peer: dict) -> list[str]:
    parts = []
    for scenario, key, percentile in RATIO_METRICS:
        a, b = ours["scenarios"].get(scenario), peer["scenarios"].get(scenario)
        if a and b:
            label = f"{scenario} {key.replace('_s', '')}{' ' + percentile if percentile else ''}"
            mine, theirs = _value(a, key, percentile), _value(b, key, percentile)
            # a peer whose every request failed measures 0: no ratio, said so
            parts.append(f"{label}: {mine / theirs:.2f}x" if theirs > 0
                         else f"{label}: - (the peer measured 0)")
    return parts


def speculation_lines(records: list[dict]) -> list[str]:
    """Each speculating variant beside its base system (the name without the ending):
    TPOT speed-up and throughput ratio per scenario, and the drafts the server accepted."""
    by_name = {record["system"]: record for record in records}
    lines = []
    for record in records:
        ending = next((e for e in SPECULATING if record["system"].endswith(e)), None)
        base = by_name.get(record["system"][:-len(ending)]) if ending else None
        if base is None:
            continue
        parts = []
        for scenario, summary in record["scenarios"].items():
            plain = base["scenarios"].get(scenario)
            if not plain:
                continue
            speedup = _value(plain, "tpot_s", "p50") / _value(summary, "tpot_s", "p50")
            part = (f"{scenario} TPOT p50 {speedup:.2f}x, out tok/s "
                    f"{summary['output_throughput'] / plain['output_throughput']:.2f}x")
            server = summary.get("server") or {}
            if server.get("spec_decode_num_draft_tokens"):
                part += (f" (accepted {server['spec_decode_num_accepted_tokens']:.0f} of "
                         f"{server['spec_decode_num_draft_tokens']:.0f} drafts, "
                         f"{server['spec_decode_mean_accepted_per_step']:.2f} per step)")
            parts.append(part)
        if parts:
            lines.append(f"- {record['system']} over {base['system']}: " + "; ".join(parts))
    if not lines:
        return []
    return ["", "Speculation, each variant over its base system (TPOT: base / variant, higher "
            "is faster; throughput: variant / base; drafts as the server counted them):",
            ""] + lines


def structured_lines(records: list[dict]) -> list[str]:
    """Each system's constrained scenarios beside its free-text ones of the same shape."""
    lines = []
    for record in records:
        parts = []
        for constrained, free in STRUCTURED.items():
            summary, plain = record["scenarios"].get(constrained), record["scenarios"].get(free)
            if summary and plain:
                parts.append(f"{constrained}/{free} TPOT p50 "
                             f"{_value(summary, 'tpot_s', 'p50') / _value(plain, 'tpot_s', 'p50'):.3f}x, "
                             f"out tok/s {summary['output_throughput'] / plain['output_throughput']:.3f}x")
        if parts:
            lines.append(f"- {record['system']}: " + "; ".join(parts))
    if not lines:
        return []
    return ["", "Structured output, each system's JSON-schema scenario over its free-text one of "
            "the same shape (TPOT: constrained / free, lower is better; throughput: constrained "
            "/ free):", ""] + lines


def roof_lines(records: list[dict], roof: dict | None) -> list[str]:
    """The output and prefill rates of the scenarios run as fractions of the roof of the engine's
    default format."""
    columns = [column for column in ROOF_COLUMNS
               if any(column[1] in record["scenarios"] for record in records)]
    if not roof or not columns:
        return []
    machine, cost = MachineRoof(**roof["machine"]), ModelCost(**roof["model"])
    gemm_dtype = roof.get("roof_gemm_dtype", "bfloat16")  # runs before per-CPU results: bf16
    fmt = roof.get("weight_format") or {"dtype": "bfloat16", "quantization": "none"}
    bf16 = "native" if machine.native_bf16 else "emulated, not used for the roof"
    lines = ["", f"Roof (measured here): {machine.memory_gbps:.0f} GB/s read, "
             f"{machine.gemm_gflops['bfloat16']:.0f} GFLOP/s bf16 ({bf16}) and "
             f"{machine.gemm_gflops['float32']:.0f} fp32 GEMM at the model's MLP shape. "
             f"Fractions of the roof of {fmt['dtype']}, quantization {fmt['quantization']} "
             f"({cost.weight_bytes / 1e6:.0f} MB read per step, {gemm_dtype} GEMM rate; decode: "
             "min of bandwidth and GEMM bounds at the scenario's concurrency; prefill: TTFT p50 "
             "of one stream against the GEMM bound):", "",
             "| system | " + " | ".join(column[0] for column in columns) + " |",
             "|" + "---|" * (1 + len(columns))]
    for record in records:
        cells = [_roof_cell(record["scenarios"].get(scenario), concurrency, input_len, key, cost,
                            machine, gemm_dtype)
                 for _, scenario, concurrency, input_len, key in columns]
        lines.append(f"| {record['system']} | " + " | ".join(cells) + " |")
    return lines


def _roof_cell(summary: dict | None, concurrency: int, input_len: int, key: str,
               cost: ModelCost, machine: MachineRoof, gemm_dtype: str) -> str:
    if not summary:
        return "-"
    if concurrency == 1:  # one stream: its output rate is 1 / TPOT
        summary = dict(summary, output_throughput=1 / summary["tpot_s"]["p50"])
    fractions = roof_fractions(summary, cost, machine, concurrency, input_len, 128, gemm_dtype)
    return f"{fractions[key]:.0%}"


VLLM_CLIENT_KEY = "scenarios_vllm_client"  # a record's summaries measured by vLLM's client


def _as_measured_by(records: list[dict], key: str) -> list[dict]:
    """The records with another client's summaries in place of ours (tables read
    record["scenarios"])."""
    return [dict(record, scenarios=record.get(key) or {}) for record in records]


def vllm_client_lines(records: list[dict]) -> list[str]:
    """The same systems measured by `vllm bench serve`: the headline numbers, since they are
    the ones a vLLM user would accept."""
    if not any(record.get(VLLM_CLIENT_KEY) for record in records):
        return []
    measured = _as_measured_by(records, VLLM_CLIENT_KEY)
    return (["## Measured with vLLM's client (the headline)", "",
             "`vllm bench serve` (vLLM-CPU's venv), random dataset: random token ids decoded "
             "to text, seed 7 (s5: 8, its own prompts), `--ignore-eos`, same concurrency and "
             "lengths as below; s4 has no counterpart. Cold start as measured by the run.", ""]
            + scenario_table(measured) + [""] + ratio_lines(measured)
            + speculation_lines(measured) + structured_lines(measured)
            + ["", "## Measured with kvserve's client", ""])


def run_markdown(records: list[dict], title: str, machine: str, roof: dict | None = None,
                 plots: list[str] | None = None, model: str = DEFAULT_MODEL) -> str:
    lines = [f"# {title}", "", machine, ""] + vllm_client_lines(records)
    lines += ["Client: `kvserve bench serve` (streaming /v1/completions, ignore_eos, greedy but "
              "s5), loopback, one system at a time. Prompts cut from the Python standard "
              "library's source. " + SCENARIO_TEXT, "", configuration_line(roof, model), ""]
    lines += scenario_table(records)
    lines += [""] + ratio_lines(records)
    lines += speculation_lines(records) + structured_lines(records)
    lines += roof_lines(records, roof)
    failed = ", ".join(f"{r['system']} {k}{by}: {v['failed']}" for r in records
                       for key, by in (("scenarios", ""), (VLLM_CLIENT_KEY, " (vLLM's client)"))
                       for k, v in (r.get(key) or {}).items() if v.get("failed"))
    lines += ["", f"Failed requests: {failed or 'none'}."]
    if plots:
        lines += ["", "Latency CDFs: " + ", ".join(f"[{Path(p).stem}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


BENCHMARKS_INTRO = (
    "# Latest benchmarks, one table per CPU\n\n"
    "Written by `make bench` (`benchmarks/run.py`) from `benchmarks/results/`: for each CPU "
    "(model name, family, model number, and the kernel instruction-set level where capped "
    "below the CPU's best) its headline run: the latest of the default model covering the most "
    "standard scenarios (one-off runs of other scenarios or models sit beside it). Our "
    "machines differ in CPU (AVX-512 with BF16 on Zen 4 and Zen 5, AVX2 only on Zen 3), so "
    "compare systems within a table, not across tables.\n")


def _relative_links(text: str, prefix: str) -> str:
    """Links relative to the run's markdown, made relative to the repository root."""
    return re.sub(r"\]\((?!https?:|/|#)", f"]({prefix}/", text)


def run_section(run: SavedRun, repo_root: Path) -> str:
    markdown_dir = run.markdown_path.parent.resolve().relative_to(repo_root.resolve()).as_posix()
    if run.markdown_path.exists():
        body = run.markdown_path.read_text().split("\n", 2)[2]  # without its title line
    else:
        body = f"Machine: {run.label}.\n\n" + "\n".join(scenario_table(run.records)) + "\n"
    section = (f"## {run.label}\n\nFrom `{markdown_dir}/{run.markdown_path.name}`.\n\n"
               + _relative_links(body, markdown_dir))
    if run.notes_path.exists():
        section = section.rstrip("\n") + "\n\n" + run.notes_path.read_text()
    return section.rstrip("\n") + "\n"


def benchmarks_markdown(runs: list[SavedRun], repo_root: Path) -> str:
    return BENCHMARKS_INTRO + "".join("\n" + run_section(run, repo_root) for run in runs)
