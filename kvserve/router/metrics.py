"""The router's Prometheus metrics (`kvserve_router:` names), in a registry of its own.

Besides traffic per replica, it counts how well it placed requests: the prompt blocks it
predicted cached on the chosen replica, and with --measure-placement the blocks the chosen
replica and the best replica actually held (asked of every replica before forwarding).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvserve_router:requests", "Requests forwarded, per replica",
                                ["replica"], registry=r)
        self.failures = Counter("kvserve_router:replica_failures", "Requests a replica failed "
                                "before or while answering", ["replica"], registry=r)
        self.retries = Counter("kvserve_router:retries", "Requests sent to a second replica "
                               "after the first failed before answering", registry=r)
        self.unroutable = Counter("kvserve_router:no_replica", "Requests refused: no healthy "
                                  "replica", registry=r)
        self.healthy = Gauge("kvserve_router:replica_healthy", "1 while the replica is a "
                             "candidate", ["replica"], registry=r)
        self.indexed_blocks = Gauge("kvserve_router:replica_indexed_blocks", "Block hashes the "
                                    "index holds for the replica", ["replica"], registry=r)
        self.active_blocks = Gauge("kvserve_router:replica_active_blocks", "KV blocks the "
                                   "router counts in use on the replica", ["replica"], registry=r)
        self.prompt_blocks = Counter("kvserve_router:prompt_blocks", "Full prompt blocks of "
                                     "routed requests", registry=r)
        self.predicted_blocks = Counter("kvserve_router:predicted_cached_blocks", "Of those, "
                                        "cached on the chosen replica by the index", registry=r)
        self.placements = Counter("kvserve_router:placement_decisions", "Placements measured "
                                  "(--measure-placement)", registry=r)
        self.placements_best = Counter("kvserve_router:placement_best", "Measured placements "
                                       "on a replica holding the most prefix blocks",
                                       registry=r)
        self.chosen_blocks = Counter("kvserve_router:placement_chosen_blocks", "Prefix blocks "
                                     "the chosen replica actually held", registry=r)
        self.best_blocks = Counter("kvserve_router:placement_best_blocks", "Prefix blocks the "
                                   "best replica held", registry=r)
        self.index_matches = Counter("kvserve_router:placement_index_exact", "Measured "
                                     "placements where the index's overlap for the chosen "
                                     "replica was exact", registry=r)

        self.remote_prefills = Counter("kvserve_router:remote_prefills", "Disaggregated mode: "
                                       "prompts prefilled on a prefill server and handed to a "
                                       "decode server", registry=r)
        self.local_prefills = Counter("kvserve_router:local_prefills", "Disaggregated mode: "
                                      "prompts the decode server prefilled itself, by why "
                                      "(short, several_choices, several_prompts, unreadable, "
                                      "no_prefill_replica, prefill_failed)", ["reason"],
                                      registry=r)
        self.prefill_seconds = Histogram("kvserve_router:prefill_seconds", "Disaggregated "
                                         "mode: seconds of the prefill step (request to "
                                         "handle)", registry=r, buckets=(
                                             .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10,
                                             30))

    def render(self) -> bytes:
        return generate_latest(self.registry)
