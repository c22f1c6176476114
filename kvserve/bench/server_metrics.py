"""What the servers counted during a benchmark run: their prefix-cache hit rate, their
speculative drafts and how many were accepted, and, behind a `kvserve router`, how well it placed
requests. Read from /metrics before and after the run (the
difference is the run's); behind a router, the replicas' URLs come from its /router/state."""

from __future__ import annotations

import httpx

from kvserve.router.replicas import parse_metrics

_PLACEMENT = ("decisions", "best", "chosen_blocks", "best_blocks", "index_exact")
_SPECULATION = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vLLM's counters
_PREFIXES = ("kvserve", "vllm")  # ours, and a vLLM peer's


def metrics_urls(base_url: str, explicit: list[str] | None, headers: dict) -> tuple[list[str],
                                                                                    bool]:
    """(servers whose prefix-cache counters to read, whether base_url is a router)."""
    try:
        state = httpx.get(base_url + "/router/state", headers=headers, timeout=10)
        router = state.status_code == 200 and "replicas" in state.json()
    except (httpx.HTTPError, ValueError):
        router = False
    if explicit:
        return explicit, router
    return (list(state.json()["replicas"]) if router else [base_url]), router


def read(base_url: str, urls: list[str], router: bool, headers: dict) -> dict[str, float]:
    counts = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0,
              **{f"spec_decode_{name}": 0.0 for name in _SPECULATION}}
    for url in urls:
        try:
            values = parse_metrics(httpx.get(url + "/metrics", headers=headers,
                                             timeout=10).text)
        except (httpx.HTTPError, ValueError):
            continue  # down, or no Prometheus text (llama.cpp's): nothing counted
        for name in ("prefix_cache_queries", "prefix_cache_hits",
                     *(f"spec_decode_{name}" for name in _SPECULATION)):
            counts[name] += _counter(values, name)
    if router:
        values = parse_metrics(httpx.get(base_url + "/metrics", headers=headers,
                                         timeout=10).text)  # the router: must answer
        for name in _PLACEMENT:
            counts[f"placement_{name}"] = values.get(f"kvserve_router:placement_{name}_total",
                                                     0.0)
    return counts


def _counter(values: dict[str, float], name: str) -> float:
    """A counter by its vLLM name, as kvserve or vLLM itself exports it (our counters take
    vLLM's names under our prefix; a vLLM peer's acceptance reads in the same report)."""
    for prefix in _PREFIXES:
        if f"{prefix}:{name}_total" in values:
            return values[f"{prefix}:{name}_total"]
    return 0.0


def run_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The run's counts, and the rates they give."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    queries = delta["prefix_cache_queries"]
    delta["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queries if queries else 0.0
    drafted = delta.get("spec_decode_num_draft_tokens", 0.0)
    if drafted:
        delta["spec_decode_acceptance_rate"] = delta["spec_decode_num_accepted_tokens"] / drafted
        delta["spec_decode_mean_accepted_per_step"] = \
            delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_drafts"]
    decisions = delta.get("placement_decisions")
    if decisions:
        delta["placement_accuracy"] = delta["placement_best"] / decisions
        best_blocks = delta["placement_best_blocks"]
        delta["placement_block_ratio"] = delta["placement_chosen_blocks"] / best_blocks \
            if best_blocks else 1.0
    return delta


def describe(delta: dict[str, float], urls: list[str]) -> str:
    if not delta["prefix_cache_queries"]:
        return "prefix-cache hit rate: not counted by the server(s)"
    line = (f"prefix-cache hit rate {100 * delta['prefix_cache_hit_rate']:.1f}% "
            f"({delta['prefix_cache_hits']:.0f} of {delta['prefix_cache_queries']:.0f} prompt "
            f"tokens, {len(urls)} server(s))")
    if delta.get("spec_decode_num_draft_tokens"):
        line += (f"; speculation: {delta['spec_decode_num_accepted_tokens']:.0f} of "
                 f"{delta['spec_decode_num_draft_tokens']:.0f} draft tokens accepted "
                 f"({100 * delta['spec_decode_acceptance_rate']:.1f}%), "
                 f"{delta['spec_decode_mean_accepted_per_step']:.2f} per step with drafts")
    if delta.get("placement_decisions"):
        line += (f"; placement: the replica holding the most prefix blocks chosen for "
                 f"{delta['placement_best']:.0f} of {delta['placement_decisions']:.0f} requests "
                 f"({100 * delta['placement_accuracy']:.1f}%), chosen/best blocks "
                 f"{delta['placement_chosen_blocks']:.0f}/{delta['placement_best_blocks']:.0f}")
    return line
