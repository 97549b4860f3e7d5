"""Prometheus metrics under vLLM's names with a `zcode:` prefix, labelled by `model_name`.

Dashboards written for vLLM work after renaming the prefix. Gauges and prefix-cache counters
follow the engine's own statistics (read by the engine thread after every step); latencies are
measured with `time.monotonic()` from the request's arrival at the HTTP server.
"""

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` series next to every counter: vLLM has none either

CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# engine stats key -> counter name; the engine reports running totals, we add the increase
_TOTALS = {
    "prefix_cache_queries": "zcode:prefix_cache_queries",
    "prefix_cache_hits": "zcode:prefix_cache_hits",
    "num_preemptions": "zcode:num_preemptions",
    # expert offload (engine stats carry these only with an expert cache)
    "expert_cache_lookups": "zcode:expert_cache_lookups",
    "expert_cache_hits": "zcode:expert_cache_hits",
    "expert_cache_read_bytes": "zcode:expert_cache_disk_read_bytes",
    "expert_cache_prefetched": "zcode:expert_cache_prefetched_experts",
    "expert_cache_prefetch_hits": "zcode:expert_cache_prefetch_hits",
    # speculative decoding: verify steps with drafts, drafted tokens, accepted tokens
    "spec_decode_num_drafts": "zcode:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "zcode:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "zcode:spec_decode_num_accepted_tokens",
}


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.num_running = gauge("zcode:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("zcode:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("zcode:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.expert_resident = gauge(
            "zcode:expert_cache_resident_bytes", "Routed experts' bytes the expert cache keeps."
        )
        self.totals = {
            key: counter(name, f"Running total of the engine's {key}.")
            for key, name in _TOTALS.items()
        }
        self._last_totals = {key: 0 for key in _TOTALS}
        self.accepted_per_pos = Counter(
            "zcode:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by their position in the draft.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._last_accepted_per_pos: list[int] = []
        self.prompt_tokens = counter("zcode:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("zcode:generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            "zcode:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # AnomalyGuard's kinds (finish_reason "anomaly", the kind as stop_reason)
        self.anomalies = Counter(
            "zcode:request_anomalies",
            "Requests ended by the anomaly guard, by kind.",
            ["model_name", "kind"],
            registry=self.registry,
        )
        self.ttft = histogram(
            "zcode:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS_S
        )
        self.itl = histogram(
            "zcode:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS_S
        )
        self.e2e = histogram(
            "zcode:e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS_S
        )

    def engine_stats(self, stats: dict) -> None:
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        if "expert_cache_resident_bytes" in stats:
            self.expert_resident.set(stats["expert_cache_resident_bytes"])
        for key, counter in self.totals.items():
            total = stats.get(key, 0)
            if total > self._last_totals[key]:
                counter.inc(total - self._last_totals[key])
            self._last_totals[key] = total
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", [])
        last = self._last_accepted_per_pos + [0] * (len(per_pos) - len(self._last_accepted_per_pos))
        for position, (total, before) in enumerate(zip(per_pos, last)):
            if total > before:
                self.accepted_per_pos.labels(self.model_name, str(position)).inc(total - before)
        self._last_accepted_per_pos = list(per_pos)

    def tokens_generated(self, stream, out, now: float) -> None:
        num_new = len(out.delta_token_ids or ())
        if num_new == 0:
            return
        self.generation_tokens.inc(num_new)
        if stream.first_token_time is None:
            stream.first_token_time = now
            self.prompt_tokens.inc(stream.num_prompt_tokens)
            self.ttft.observe(now - stream.arrival_time)
        else:
            self.itl.observe(now - stream.last_token_time)
        stream.last_token_time = now

    def request_finished(
        self, stream, finish_reason: str | None, now: float, stop_reason=None
    ) -> None:
        self.e2e.observe(now - stream.arrival_time)
        self.request_success.labels(self.model_name, finish_reason or "abort").inc()
        if finish_reason == "anomaly":
            self.anomalies.labels(self.model_name, str(stop_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
