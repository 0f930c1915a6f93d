"""Metrics of every replica, per replica and summed: what the ingress serves at `/metrics`.

Owns: `MetricsBoard`, a small Ray actor (one per Serve application, named, detached) to which
each replica puts its server's `/metrics` text every `PUBLISH_PERIOD_S` (replica servers listen
on loopback only, so their metrics travel through Ray, not HTTP between nodes); `board(app_name)`
gets or creates it; `merge_metrics(texts)` merges replicas'
Prometheus texts with `prometheus_client`'s parser: every sample gains a `replica` label, and
counters, histograms and the `*_num_requests_*` gauges also appear summed with
`replica="all"` (ratios such as KV-cache usage are per replica only).

In: {replica id: Prometheus text} (the ingress reads the board's fresh entries). Out: one
Prometheus text (`prometheus_client.generate_latest`).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest, parser
from prometheus_client.metrics_core import Metric

import ray

NAMESPACE = "continuum"
PUBLISH_PERIOD_S = 1.0       # how often a replica puts its metrics (seconds)
STALE_S = 10.0               # metrics older than this are a gone replica's (seconds)


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Replica id → (its latest Prometheus text, when it was put: time.time() seconds)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica_id: str, text: str) -> None:
        """A replica's current metrics."""
        self.texts[replica_id] = (text, time.time())

    def remove(self, replica_id: str) -> None:
        """Forget a replica (it stopped)."""
        self.texts.pop(replica_id, None)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        """{replica id: text} of replicas that put metrics in the last `max_age_s` seconds
        (a replica that died without `remove` drops out after that)."""
        now = time.time()
        return {rid: text for rid, (text, at) in self.texts.items() if now - at <= max_age_s}


def board(app_name: str):
    """The `MetricsBoard` actor of Serve application `app_name` (created on first use;
    detached, so that it outlives the replica or ingress that created it)."""
    return MetricsBoard.options(name=f"metrics:{app_name}", namespace=NAMESPACE,
                                get_if_exists=True, lifetime="detached").remote()


def _summed(family: Metric) -> bool:
    return family.type in ("counter", "histogram") or (
        family.type == "gauge" and "_num_requests_" in family.name)


class _Merged:
    """A prometheus_client collector over parsed families (see `merge_metrics`)."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple, float]] = {}
        for replica, text in sorted(self.texts.items()):
            for fam in parser.text_string_to_metric_families(text):
                out = families.setdefault(fam.name, Metric(fam.name, fam.documentation,
                                                           fam.type))
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": replica}, s.value)
                    if _summed(fam) and not fam.name.endswith("_created"):
                        key = (s.name, tuple(sorted(s.labels.items())))
                        bucket = sums.setdefault(fam.name, {})
                        bucket[key] = bucket.get(key, 0.0) + s.value
        for name, fam in families.items():
            for (sample, labels), value in sums.get(name, {}).items():
                fam.add_sample(sample, {**dict(labels), "replica": "all"}, value)
            yield fam


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One Prometheus text from {replica id: Prometheus text}: each sample with a `replica`
    label, counters / histograms / request-count gauges also summed as `replica="all"`.
    Raises ValueError if a text is not in Prometheus' exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)
