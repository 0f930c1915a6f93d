"""Triton's `nv_inference_*` metrics, read from each model's statistics at scrape time.

Owns: a prometheus-client collector registered on the server's registry, so `/metrics` shows
Triton's names (server/docs/user_guide/metrics.md) with `model` and `version` labels (and
`reason` on failures, as tritonserver 2.51) beside
the LLM's `continuum_*` metrics. Counters are cumulative (durations in microseconds); the
pending-request count is a gauge. Nothing is counted twice: the values come from `ModelStats`.
"""

from __future__ import annotations

from prometheus_client.core import Metric

_COUNTERS = [
    ("nv_inference_request_success", "Number of successful inference requests",
     lambda s: s.success.count),
    ("nv_inference_count", "Number of inferences performed (batch rows)",
     lambda s: s.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed",
     lambda s: s.execution_count),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in us",
     lambda s: (s.success.ns + s.fail.ns) // 1000),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in us",
     lambda s: s.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in us",
     lambda s: s.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in us",
     lambda s: s.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output "
     "duration in us", lambda s: s.compute_output.ns // 1000),
]


class TritonCollector:
    """prometheus-client custom collector over a `ModelRepository` getter."""

    def __init__(self, get_repository) -> None:
        self.get_repository = get_repository

    def collect(self):
        """Yield one metric family per Triton name, one sample per loaded model version."""
        repo = self.get_repository()
        runtimes = repo.all_runtimes() if repo is not None else []
        failure = Metric("nv_inference_request_failure",
                         "Number of failed inference requests, all batch sizes", "counter")
        for model, version, rt in runtimes:
            for reason, count in rt.stats.fail_reasons.items():
                failure.add_sample("nv_inference_request_failure", {
                    "model": model, "reason": reason, "version": str(version)}, count)
        yield failure
        for name, doc, read in _COUNTERS:
            family = Metric(name, doc, "counter")
            for model, version, rt in runtimes:
                family.add_sample(name, {"model": model, "version": str(version)},
                                  read(rt.stats))
            yield family
        gauge = Metric("nv_inference_pending_request_count",
                       "Instantaneous number of pending requests awaiting execution", "gauge")
        for model, version, rt in runtimes:
            gauge.add_sample("nv_inference_pending_request_count",
                             {"model": model, "version": str(version)}, rt.pending_count)
        yield gauge
