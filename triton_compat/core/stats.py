"""Per-model statistics in the shape of Triton's statistics extension.

Owns: the counters behind `GET /v2/models/{m}/stats` and the `nv_inference_*` metrics, updated
by the worker that ran a batch (one lock; a few integer additions per batch).
Definitions (server/docs/protocol/extension_statistics.md): per request — success / fail
count and total duration (queue entry to response), queue duration, and the compute input /
infer / output durations of the execution it was part of; `inference_count` counts batch rows
(a request of batch 4 counts 4), `execution_count` counts executions; `batch_stats` has the
compute durations per executed batch size, counted once per execution. Durations in ns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# the `reason` label values of Triton 2.51's nv_inference_request_failure
FAIL_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


@dataclass
class Duration:
    """A count and a total duration in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        """Add `count` events that took `ns` nanoseconds each."""
        self.count += count
        self.ns += ns * count

    def json(self) -> dict:
        """`{"count": .., "ns": ..}` as the extension writes it."""
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """The statistics of one model version; thread-safe."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch: dict = field(default_factory=dict)    # batch size -> [input, infer, output]
    # failures by Triton's `reason` label of nv_inference_request_failure
    fail_reasons: dict = field(default_factory=lambda: dict.fromkeys(FAIL_REASONS, 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_failure(self, duration_ns: int, reason: str = "REJECTED") -> None:
        """A request that failed before execution (a queue timeout: REJECTED)."""
        with self.lock:
            self.fail.add(duration_ns)
            self.fail_reasons[reason] += 1

    def record_execution(self, enqueued_ns: list[int], batch_sizes: list[int], results,
                         start_ns: int, end_ns: int, times, padded_size: int = 0) -> None:
        """One execution of len(results) requests: when each was queued, its batch rows, its
        result (outputs or an Exception), the execution's start / end (ns, perf_counter) and
        its `ExecTimes` (None when the backend itself crashed). `padded_size`: the executed
        batch size when the sequence batcher padded it (0: the requests' rows)."""
        with self.lock:
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1000)
            if times is not None:
                size = padded_size or sum(batch_sizes)
                per_size = self.batch.get(size)
                if per_size is None:
                    per_size = self.batch[size] = [Duration(), Duration(), Duration()]
                for d, ns in zip(per_size, (times.input_ns, times.infer_ns, times.output_ns)):
                    d.add(ns)
            ok, success, queue = 0, self.success, self.queue
            for t0, rows, result in zip(enqueued_ns, batch_sizes, results):
                if isinstance(result, Exception):
                    self.fail.add(end_ns - t0)
                    self.fail_reasons["BACKEND"] += 1
                    continue
                ok += 1
                success.ns += end_ns - t0
                queue.ns += start_ns - t0
                self.inference_count += rows
            success.count += ok
            queue.count += ok
            if times is not None and ok:       # each request counts its execution's times
                self.compute_input.add(times.input_ns, ok)
                self.compute_infer.add(times.infer_ns, ok)
                self.compute_output.add(times.output_ns, ok)

    def record_request(self, ok: bool, duration_ns: int, batch_size: int,
                       queue_ns: int = 0) -> None:
        """A request served without a batcher of its own (an ensemble, the LLM): one execution
        each; `queue_ns` its time before it ran. Every success counts a queue entry, as Triton
        does (perf_analyzer finds a model's version by that count)."""
        with self.lock:
            (self.success if ok else self.fail).add(duration_ns)
            if not ok:
                self.fail_reasons["BACKEND"] += 1
            if ok:
                self.queue.add(queue_ns)
                self.inference_count += batch_size
                self.execution_count += 1
                self.last_inference_ms = int(time.time() * 1000)

    def json(self, name: str, version: str) -> dict:
        """One entry of `model_stats` in the statistics extension's response."""
        with self.lock:
            return {
                "name": name, "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.json(), "fail": self.fail.json(),
                    "queue": self.queue.json(), "compute_input": self.compute_input.json(),
                    "compute_infer": self.compute_infer.json(),
                    "compute_output": self.compute_output.json(),
                    "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
                "batch_stats": [
                    {"batch_size": size, "compute_input": d[0].json(),
                     "compute_infer": d[1].json(), "compute_output": d[2].json()}
                    for size, d in sorted(self.batch.items())],
                "memory_usage": [],
            }
