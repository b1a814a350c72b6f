"""Prometheus metrics on a private :class:`CollectorRegistry` (never the global one).

Engine counters and gauges are read at scrape time from the snapshot the engine thread
publishes (``EngineLoop.stats``), so ``/metrics`` never touches the engine itself.
Latency histograms are observed by the engine thread as tokens are produced.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "METRIC_DOCS", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)

# name -> (kind, engine stats key, help); the engine-derived metrics.
_GAUGES = {
    "flexpage_num_requests_running": ("num_requests_running",
                                      "Requests holding KV blocks (being prefilled or decoded)."),
    "flexpage_num_requests_waiting": ("num_requests_waiting", "Requests queued or swapped out, waiting for blocks."),
    "flexpage_kv_blocks_total": ("kv_blocks_total", "Usable KV blocks in the pool (block 0 is reserved)."),
    "flexpage_kv_blocks_used": ("kv_blocks_used", "KV blocks referenced by live sequences."),
    "flexpage_kv_blocks_free": ("kv_blocks_free", "KV blocks holding nothing."),
    "flexpage_kv_blocks_cached": ("kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse (evictable)."),
    "flexpage_kv_cache_usage": (None, "Fraction of usable KV blocks referenced by live sequences (used / total)."),
    "flexpage_kv_utilization": ("kv_utilization",
                                "Token slots filled / token slots allocated over blocks held by running sequences."),
    "flexpage_kv_capacity_tokens": ("kv_capacity_tokens", "Tokens the KV pool can hold."),
    "flexpage_prefix_cache_hit_rate": ("prefix_cache_hit_rate",
                                       "Prompt tokens served from the prefix cache / prompt tokens looked up."),
    "flexpage_swapped_blocks": ("swapped_blocks", "KV blocks currently swapped out to host memory."),
    "flexpage_kv_host_tier_bytes": ("kv_host_bytes_used", "Bytes of prefix-cache blocks kept in the host-memory tier."),
    "flexpage_kv_host_tier_blocks": ("kv_host_blocks_used", "Blocks kept in the host-memory tier."),
    "flexpage_kv_disk_tier_bytes": ("kv_disk_bytes_used", "Bytes of prefix-cache blocks kept in the disk tier."),
    "flexpage_kv_disk_tier_blocks": ("kv_disk_blocks_used", "Blocks kept in the disk tier."),
}
_COUNTERS = {
    "flexpage_preemptions": ("preemptions", "Sequences preempted (recompute or swap) to free KV blocks."),
    "flexpage_prompt_tokens": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "flexpage_generation_tokens": ("generation_tokens", "Tokens generated."),
    "flexpage_prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "flexpage_prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "flexpage_kv_evicted_blocks": ("kv_evicted_blocks", "KV block-table entries sequences gave up to stay within "
                                                        "their KV budget (kv_budget)."),
    "flexpage_kv_evicted_tokens": ("kv_evicted_tokens", "Token slots in those blocks."),
    "flexpage_kv_spilled_tokens": ("kv_spilled_tokens", "Tokens of prefix-cache blocks the pool evicted into the "
                                                        "host/disk tiers."),
    "flexpage_kv_restored_host_tokens": ("kv_restored_host_tokens", "Prompt tokens whose KV was restored from the "
                                                                    "host tier."),
    "flexpage_kv_restored_disk_tokens": ("kv_restored_disk_tokens", "Prompt tokens whose KV was restored from the "
                                                                    "disk tier."),
    "flexpage_kv_dropped_tokens": ("kv_dropped_tokens", "Tokens of tiered blocks dropped for good (the tiers were "
                                                        "full)."),
    "flexpage_kv_released_tokens": ("kv_released_tokens", "Tokens of tiered copies let go while the pool held the "
                                                          "same blocks (spilled again if the pool evicts them)."),
    "flexpage_kv_hole_recomputed_tokens": ("kv_hole_recomputed_tokens", "Tokens recomputed in front of blocks "
                                                                        "restored behind a dropped head."),
    "flexpage_grammar_compiles": ("grammar_compiles", "Output constraints (schemas, regexes, grammars) compiled "
                                                      "for the first time."),
    "flexpage_grammar_cache_hits": ("grammar_cache_hits", "Output constraints found compiled already."),
    "flexpage_spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Proposed tokens verified "
                                                                              "(speculative decoding)."),
    "flexpage_spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
    "flexpage_spec_decode_num_drafts": ("spec_decode_num_drafts", "Verifications: sequences' steps that checked "
                                                                  "proposed tokens."),
    "flexpage_spec_decode_num_tree_drafts": ("spec_decode_num_tree_drafts", "Of those, verifications of several "
                                                                            "branches at once (max_branches > 1)."),
    "flexpage_conversation_turns": ("conversation_turns", "Finished turns of requests that named a conversation."),
    "flexpage_conversation_history_tokens": ("conversation_history_tokens", "Tokens of earlier turns that later "
                                                                            "turns carried in their prompts."),
    "flexpage_conversation_reused_tokens": ("conversation_reused_tokens", "Of those, tokens served from the cache "
                                                                          "(pool or tiers)."),
    "flexpage_conversation_recomputed_tokens": ("conversation_recomputed_tokens", "Of those, tokens computed "
                                                                                  "again."),
}

#: Every exported metric with its type and help text (docs/serving.md mirrors this).
METRIC_DOCS: dict[str, tuple[str, str]] = {
    **{name: ("gauge", help) for name, (_, help) in _GAUGES.items()},
    **{name + "_total": ("counter", help) for name, (_, help) in _COUNTERS.items()},
    "flexpage_requests_finished_total": ("counter", "Requests finished, by finish_reason (stop, length, abort)."),
    "flexpage_http_requests_total": ("counter", "HTTP responses by endpoint and status code."),
    "flexpage_time_to_first_token_seconds": ("histogram", "Time from request arrival to its first token."),
    "flexpage_inter_token_latency_seconds": ("histogram", "Time between consecutive tokens of a request."),
    "flexpage_e2e_request_latency_seconds": ("histogram", "Time from request arrival to its last token."),
    "flexpage_cpu_path_info": ("gauge", "1 for each path this process takes (dtype, torch patches, attention "
                                        "kernels, projections, GGUF block kernel), by path, choice and ok "
                                        "(false: a fallback, see the reason in the banner or flexpage env)."),
    "flexpage_kernel_fallbacks": ("gauge", "Paths that fell back to a slower one because a kernel could not be built "
                                           "or used (0 when every kernel runs)."),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, (key, help) in _GAUGES.items():
            if key is None:
                value = stats.get("kv_blocks_used", 0) / max(1, stats.get("kv_blocks_total", 0))
            else:
                value = stats.get(key, 0)
            yield GaugeMetricFamily(name, help, value=float(value))
        for name, (key, help) in _COUNTERS.items():
            yield CounterMetricFamily(name, help, value=float(stats.get(key, 0)))


class _PathCollector(Collector):
    """The CPU description's record of paths taken (:mod:`flexpage.backends.cpu.description`)."""

    def collect(self) -> Iterator[Metric]:
        from flexpage.backends.cpu.description import describe

        paths = describe().paths.paths()
        info = GaugeMetricFamily("flexpage_cpu_path_info", METRIC_DOCS["flexpage_cpu_path_info"][1],
                                 labels=["path", "choice", "ok"])
        for path in paths:
            info.add_metric([path.name, path.choice, "true" if path.ok else "false"], 1.0)
        yield info
        yield GaugeMetricFamily("flexpage_kernel_fallbacks", METRIC_DOCS["flexpage_kernel_fallbacks"][1],
                                value=float(sum(not path.ok for path in paths)))


class ServerMetrics:
    """The server's registry: engine snapshot collector, latency histograms, request counters."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        disable_created_metrics()  # no *_created series: they only add noise to every scrape
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.registry.register(_PathCollector())
        self.ttft = Histogram("flexpage_time_to_first_token_seconds", METRIC_DOCS[
            "flexpage_time_to_first_token_seconds"][1], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("flexpage_inter_token_latency_seconds", METRIC_DOCS[
            "flexpage_inter_token_latency_seconds"][1], buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("flexpage_e2e_request_latency_seconds", METRIC_DOCS[
            "flexpage_e2e_request_latency_seconds"][1], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("flexpage_requests_finished", METRIC_DOCS["flexpage_requests_finished_total"][1],
                                ["finish_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)
        self.http = Counter("flexpage_http_requests", METRIC_DOCS["flexpage_http_requests_total"][1],
                            ["endpoint", "status"], registry=self.registry)

    def observe_finish(self, reason: str | None) -> None:
        self.finished.labels(reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
