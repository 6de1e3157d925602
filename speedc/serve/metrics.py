"""Prometheus metrics of one server (its own registry, so several apps in one process never clash).

Requests: running / waiting (read from the engine adapter when scraped), by outcome (ok, refused 4xx,
failed 5xx, cancelled, with status and reason), streams that failed after their 200, generations cancelled
(client gone), timed out, finished by finish_reason. Engine steps by the number of
sequences decoded together (continuous batching at work: steps with sequences > 1). Tokens: prompt and generated.
Latency: time to first token (from the request's arrival, queueing included) and inter-token latency
(between streamed pieces; a piece is one confirmed token unless UTF-8 holds bytes back). SPEED:
speculations accepted and mispredicted, early flushes and flushed tokens; the speculation policy's decisions
(decode steps speculating and plain, fall-backs, probes, plain steps timed while speculating) and the step
costs it measured on this host (c(P) per batch size and context band, read when scraped).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("speedc_requests_running", "Generations running on the engine", registry=r)
        self.waiting = Gauge("speedc_requests_waiting", "Admitted requests waiting for the engine", registry=r)
        self.cancelled = Counter("speedc_requests_cancelled", "Generations stopped because the client went away",
                                 registry=r)
        self.timed_out = Counter("speedc_requests_timed_out", "Generations stopped by the request timeout", registry=r)
        self.finished = Counter("speedc_requests_finished", "Generations that ran to the end", ["finish_reason"],
                                registry=r)
        self.outcomes = Counter("speedc_request_outcomes", "Requests by how they ended: ok, refused (4xx: the "
                                "request's own fault or the server full), failed (5xx), cancelled (the client went "
                                "away); a stream counts by its error event's status", ["outcome", "status", "reason"],
                                registry=r)
        self.stream_failures = Counter("speedc_stream_failures", "Streams that ended with an error event after "
                                       "their 200 (the error's status and code)", ["status", "reason"], registry=r)
        self.prompt_tokens = Counter("speedc_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("speedc_generation_tokens", "Generated (confirmed) tokens", registry=r)
        self.cached_prompt_tokens = Counter("speedc_prompt_tokens_cached", "Prompt tokens whose K/V came from the "
                                            "prefix cache instead of a prefill", registry=r)
        self.prefix_cache_bytes = Gauge("speedc_prefix_cache_bytes", "Memory the prefix cache holds", registry=r)
        self.ttft = Histogram("speedc_time_to_first_token_seconds", "Request arrival to first generated text",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("speedc_inter_token_latency_seconds", "Time between streamed pieces of text",
                             buckets=ITL_BUCKETS, registry=r)
        self.accepted = Counter("speedc_speculation_accepted", "SPEED speculations confirmed by the full model",
                                registry=r)
        self.mispredicted = Counter("speedc_speculation_mispredicted", "SPEED speculations contradicted (flush)",
                                    registry=r)
        self.early_flushes = Counter("speedc_early_flushes", "SPEED flushes triggered early by a deeper exit head",
                                     registry=r)
        self.flushed_tokens = Counter("speedc_flushed_tokens", "In-flight tokens discarded by flushes", registry=r)
        self.exit_loops = Counter("speedc_token_exit_loop", "Generated tokens of requests with a depth rule, by the "
                                  "loop (from 0) whose logits they were read from", ["loop"], registry=r)
        self.policy_steps = Counter("speedc_policy_decode_steps", "Decode steps of finished requests by what the "
                                    "speculation policy chose", ["kind"], registry=r)
        self.depth_steps = Counter("speedc_policy_depth_steps", "Speed steps of finished requests by the pipeline depth "
                                   "the policy ran the slots at", ["depth"], registry=r)
        self.fallbacks = Counter("speedc_policy_fallbacks", "Times a request turned to plain decoding because "
                                 "speculation did not pay on this host", registry=r)
        self.probes = Counter("speedc_policy_probes", "Times a request speculated again after a fall-back to "
                              "measure its acceptance afresh", registry=r)
        self.cost_samples = Counter("speedc_policy_cost_samples", "Plain steps run while speculation was chosen, to "
                                    "time plain decoding here now", registry=r)

    def watch(self, adapter) -> None:
        """Read running / waiting and the engine steps from the engine adapter at each scrape."""
        self.running.set_function(lambda: adapter.running)
        self.waiting.set_function(lambda: adapter.waiting)
        self.prefix_cache_bytes.set_function(lambda: adapter.prefix_cache.nbytes if adapter.prefix_cache else 0)
        self.registry.register(_EngineSteps(adapter))
        self.registry.register(_HostCosts(adapter))

    def record_outcome(self, status: int, reason: str = "", streamed: bool = False) -> None:
        """A request ended with HTTP STATUS (a stream: its error event's, or 200), REASON: the error's code."""
        outcome = ("ok" if status < 400 else "cancelled" if status == 499 else "refused" if status < 500 else "failed")
        self.outcomes.labels(outcome, str(status), reason).inc()
        if streamed and status >= 400:
            self.stream_failures.labels(str(status), reason).inc()

    def record_finished(self, finish_reason: str, stats) -> None:
        self.finished.labels(finish_reason).inc()
        if stats is not None:
            self.accepted.inc(stats.accepted)
            self.mispredicted.inc(stats.mispredicted)
            self.early_flushes.inc(stats.early_flushes)
            self.flushed_tokens.inc(stats.flushed_tokens)
            self.policy_steps.labels("speed").inc(stats.speed_steps)
            self.policy_steps.labels("plain").inc(stats.plain_steps)
            for depth, steps in stats.depth_steps.items():
                self.depth_steps.labels(str(depth)).inc(steps)
            self.fallbacks.inc(stats.fallbacks)
            self.probes.inc(stats.probes)
            self.cost_samples.inc(stats.cost_samples)
            self.cached_prompt_tokens.inc(stats.cached_tokens)
            for loop, tokens in stats.exit_loops.items():
                self.exit_loops.labels(str(loop)).inc(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineSteps:
    """speedc_engine_steps_total{sequences="n"}: decode steps that ran n sequences together."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter

    def collect(self):
        family = CounterMetricFamily("speedc_engine_steps", "Engine decode steps by the number of sequences decoded "
                                     "together", labels=["sequences"])
        for sequences, steps in sorted(dict(self.adapter.decode_steps).items()):
            family.add_metric([str(sequences)], steps)
        yield family


class _HostCosts:
    """speedc_step_cost{sequences, context_band, depth, step}: c measured on this host (runtimes/step_costs.py)
    per pipeline depth, of a full step and of the mean step the policy decides with; speedc_step_cost_seed:
    what seeded it."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter

    def collect(self):
        report = self.adapter.host_costs()
        cost = GaugeMetricFamily("speedc_step_cost", "c measured on this host: P x a speed step's time over a plain "
                                 "token's", labels=["sequences", "context_band", "depth", "step"])
        for row in report.get("measured", []):
            for depth, values in ((report["slots"], row), *row.get("depths", {}).items()):
                for name, step in (("step_cost", "full"), ("mean_step_cost", "mean")):
                    if name in values:
                        cost.add_metric([str(row["sequences"]), str(row["context_band"]), str(depth), step], values[name])
        yield cost
        if "seed_step_cost" in report:
            seed = GaugeMetricFamily("speedc_step_cost_seed", "c(P) the policy starts from (build host or assumed)")
            seed.add_metric([], report["seed_step_cost"])
            yield seed
