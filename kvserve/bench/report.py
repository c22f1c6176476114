"""Write benchmark summaries as JSON and markdown, and draw plots with matplotlib."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _ms(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value * 1000:.1f}"


def markdown_table(rows: list[dict]) -> str:
    """One row per run: system, scenario, throughput and latency percentiles."""
    header = ("| system | scenario | done | req/s | out tok/s | TTFT p50 / p99 ms | "
              "TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms |")
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        s = row["summary"]
        lines.append(
            f"| {row.get('system', '')} | {row.get('scenario', '')} | "
            f"{s['completed']}/{s['requests']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | "
            f"{_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p99'])} | "
            f"{_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p99'])} | {_ms(s['e2e_s']['p50'])} |")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


def plot_latency_cdfs(results_by_label: dict[str, list], directory: str | Path,
                      prefix: str = "cdf") -> list[Path]:
    """CDFs of TTFT, TPOT and E2E per label (e.g. per system). Results are RequestResults or
    their per-request dicts from a saved JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for metric in ("ttft", "tpot", "e2e"):
        figure, axis = plt.subplots(figsize=(6, 4))
        for label, results in results_by_label.items():
            values = sorted(v * 1000 for v in (_metric(r, metric) for r in results)
                            if v is not None)
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))],
                          where="post", label=label)
        axis.set_xlabel(f"{metric.upper()} (ms)")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend()
        path = directory / f"{prefix}_{metric}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def _metric(result, metric: str):
    if isinstance(result, dict):
        return None if result.get("error") else result.get(metric)
    return getattr(result, metric) if result.ok else None


def plot_throughput_vs_concurrency(points: dict[str, list[tuple[int, float]]],
                                   directory: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, series in points.items():
        series = sorted(series)
        axis.plot([c for c, _ in series], [t for _, t in series], marker="o", label=label)
    axis.set_xlabel("max concurrency")
    axis.set_ylabel("output tokens/s")
    axis.set_xscale("log", base=2)
    axis.grid(alpha=0.3)
    axis.legend()
    path = directory / "throughput_vs_concurrency.png"
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
