"""Prometheus metrics: vLLM's names with the prefix `continuum_` instead of `vllm:`.

Owns: one `CollectorRegistry` per app. Fed from two places:
- the engine side, per step (`on_engine_stats(step_stats, snapshot)`): batch size, step and
  scheduler time, iteration tokens, token counters, finished requests (success by reason, E2E
  latency, queue time, prompt / generation token histograms), and the scheduler's gauges and
  cumulative counters (running / waiting / swapped, KV usage, prefix cache, preemptions by
  mode, swaps, the step's prefill budget) and, with --speculative-config, vLLM's spec_decode
  counters (drafts, draft tokens, accepted tokens, accepted per position) and the mean k chosen;
  with --enable-lora, per-adapter success and generation-token counters (`lora_name` label),
  the adapters loaded, and vLLM's `lora_requests_info`;
- the API side, per streamed delta: time to first token and inter-token latency, as the
  client sees them.

With several API processes (`--api-server-count`) the values live in prometheus-client's
multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set by api/api_servers.py): counters and
histograms sum over the processes, gauges show the most recent value; the engine's step-wide
figures and snapshot reach API process 0 alone, so each step counts once.
"""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# on_engine_stats folds the steps it kept after this many, or this long (s) after the first
FOLD_STEPS, FOLD_S = 64, 0.25
GAUGE_MODE = "mostrecent"      # several API processes: a gauge is its last writer's value

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# Cumulative scheduler counters → Prometheus counter names.
_SCHEDULER_COUNTERS = {
    "prefix_cache_queries": "continuum_prefix_cache_queries",
    "prefix_cache_hits": "continuum_prefix_cache_hits",
    "num_preemptions": "continuum_num_preemptions",
    "swap_in_blocks": "continuum_swap_in_blocks",
    "swap_out_blocks": "continuum_swap_out_blocks",
}


class Metrics:
    """All metrics of one server; `render()` gives the text exposition format."""

    def set_cache_config(self, info: dict) -> None:
        """vLLM's `cache_config_info` (value 1; the KV cache's dtype, block size and block
        counts as labels) from the engine's `engine_info`."""
        keys = ("cache_dtype", "block_size", "num_gpu_blocks", "num_cpu_blocks")
        values = (info.get("kv_cache_dtype"), info.get("block_size"),
                  info.get("num_gpu_blocks"), info.get("num_cpu_blocks"))
        Gauge("continuum_cache_config_info", "The KV cache's configuration.",
              ["model_name", *keys], registry=self.registry, multiprocess_mode=GAUGE_MODE).labels(
            self.model_name, *map(str, values)).set(1)

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.collectors: list = []              # `register`ed: rendered in every mode
        self._fold_lock = threading.Lock()      # on_engine_stats' kept steps and snapshot
        self._kept_steps: list = []
        self._kept_snapshot: dict | None = None
        self._kept_since = 0.0
        self._batched = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")   # see on_engine_stats
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r,
                         multiprocess_mode=GAUGE_MODE).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("continuum_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("continuum_num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("continuum_num_requests_swapped", "Requests swapped to the CPU pool.")
        self.kv_usage = gauge("continuum_kv_cache_usage_perc",
                              "KV-cache usage: 1 means every block is in use.")
        self.cpu_kv_usage = gauge("continuum_cpu_kv_cache_usage_perc",
                                  "CPU swap-pool usage: 1 means every swap block is in use.")
        self.success = Counter("continuum_request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = hist("continuum_time_to_first_token_seconds", "Time to first token.",
                         LATENCY_BUCKETS)
        self.itl = hist("continuum_inter_token_latency_seconds", "Time between streamed tokens.",
                        LATENCY_BUCKETS)
        self.e2e = hist("continuum_e2e_request_latency_seconds", "Arrival to finish.",
                        LATENCY_BUCKETS)
        self.queue_time = hist("continuum_request_queue_time_seconds",
                               "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prompt_hist = hist("continuum_request_prompt_tokens", "Prompt tokens per request.",
                                TOKEN_BUCKETS)
        self.gen_hist = hist("continuum_request_generation_tokens",
                             "Generated tokens per request.", TOKEN_BUCKETS)
        self.iteration_tokens = hist("continuum_iteration_tokens_total",
                                     "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.prompt_tokens = counter("continuum_prompt_tokens", "Prefill tokens computed.")
        self.generation_tokens = counter("continuum_generation_tokens", "Tokens generated.")
        self.batch_size = hist("continuum_batch_size", "Requests per engine step.", BATCH_BUCKETS)
        self.step_time = hist("continuum_step_duration_seconds", "Engine step wall time.",
                              LATENCY_BUCKETS)
        self.scheduler_time = hist("continuum_scheduler_overhead_seconds",
                                   "schedule() + update_from_output() time per step.",
                                   LATENCY_BUCKETS)
        self.scheduler_counters = {k: counter(v, f"Cumulative {k.replace('_', ' ')}.")
                                   for k, v in _SCHEDULER_COUNTERS.items()}
        by_mode = Counter("continuum_preemptions_by_mode",
                          "Preemptions by the mode used (swap or recompute; with "
                          "--preemption-mode auto, the choice made).",
                          labels + ["mode"], registry=r)
        for mode in ("swap", "recompute"):
            self.scheduler_counters[f"num_preemptions_{mode}"] = by_mode.labels(model_name, mode)
        self._last_counters: dict[str, int] = {k: 0 for k in self.scheduler_counters}
        self.prefill_budget = gauge("continuum_prefill_budget_tokens",
                                    "Prefill tokens allowed in the last step (adaptive with "
                                    "--target-itl-ms, else --max-num-batched-tokens).")
        self.step_cost = Gauge(
            "continuum_step_cost_seconds",
            "The scheduler's fitted step-cost model, t = base + per_decode * decodes + "
            "per_prefill_token * prefill tokens, on its moving window of step timings "
            "(absent until measured).", labels + ["term"], registry=r,
            multiprocess_mode=GAUGE_MODE)
        self.spec_counters = {
            "num_drafts": counter("continuum_spec_decode_num_drafts",
                                  "Request-steps that verified speculative drafts."),
            "num_draft_tokens": counter("continuum_spec_decode_num_draft_tokens",
                                        "Speculative draft tokens verified."),
            "num_accepted_tokens": counter("continuum_spec_decode_num_accepted_tokens",
                                           "Speculative draft tokens accepted."),
        }
        self._spec_per_pos = Counter("continuum_spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by draft position (0 = first).",
                                     labels + ["position"], registry=r)
        self._last_spec: dict = {"num_drafts": 0, "num_draft_tokens": 0,
                                 "num_accepted_tokens": 0, "accepted_per_pos": []}
        self.spec_mean_k = gauge("continuum_spec_decode_mean_k",
                                 "Mean speculative drafts chosen per decoding request in the "
                                 "last step (0 when speculation switched itself off).")
        self._lora_metrics(r, labels)

    def _lora_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        self.lora_success = Counter("continuum_lora_request_success",
                                    "Finished requests of each LoRA adapter, by reason.",
                                    labels + ["lora_name", "finished_reason"], registry=r)
        self.lora_generation_tokens = Counter("continuum_lora_generation_tokens",
                                              "Tokens generated by each LoRA adapter.",
                                              labels + ["lora_name"], registry=r)
        self.lora_loaded = Gauge("continuum_lora_adapters_loaded", "LoRA adapters served.",
                                 labels, registry=r,
                                 multiprocess_mode=GAUGE_MODE).labels(self.model_name)
        self.lora_info = Gauge("continuum_lora_requests_info", "vLLM's lora_requests_info: "
                               "the adapters of the running and the waiting requests (labels, "
                               "comma-separated) and max_lora; its value is the time of the "
                               "last change.", ["max_lora", "running_lora_adapters",
                                                "waiting_lora_adapters"], registry=r,
                               multiprocess_mode=GAUGE_MODE)
        self._lora_info_labels: tuple | None = None

    def _on_lora(self, lora: dict) -> None:
        self.lora_loaded.set(lora["loaded"])
        labels = (str(lora["max_loras"]), ",".join(lora["running"]), ",".join(lora["waiting"]))
        if labels != self._lora_info_labels:
            if self._lora_info_labels is not None:
                self.lora_info.remove(*self._lora_info_labels)
            self.lora_info.labels(*labels).set_to_current_time()
            self._lora_info_labels = labels

    def register(self, collector) -> None:
        """Add a custom collector (the v2 layer's) to what `render` shows."""
        self.registry.register(collector)
        self.collectors.append(collector)

    def on_engine_stats(self, step_stats: list, snapshot: dict | None) -> None:
        """Record engine steps and the scheduler snapshot (None: not this process's to show;
        `StepStats.engine_wide` False: only its requests' tokens and finishes). Any thread.

        Kept, and folded into the metrics in batches: at `render`, when a snapshot shows the
        engine idle (nothing running or waiting), after `FOLD_STEPS` steps, or `FOLD_S`
        seconds after the first one kept. Folded one step at a time, a single stream's
        figures cost ~10 % of the API process's time per token, each on caches the model's
        weights had just swept (docs/architecture.md, step 7). With several API processes
        (`PROMETHEUS_MULTIPROC_DIR`) each call folds at once: a scrape that another process
        answers cannot fold what this one kept, and only process 0 sees the idle snapshot."""
        with self._fold_lock:
            if step_stats:
                if not self._kept_steps:
                    self._kept_since = time.monotonic()
                self._kept_steps.extend(step_stats)
            if snapshot is not None:
                self._kept_snapshot = snapshot
            if self._fold_due(snapshot):
                self._fold()

    def _fold_due(self, snapshot: dict | None) -> bool:
        """Whether `on_engine_stats` folds now (see there)."""
        idle = snapshot is not None and not snapshot["num_running"] \
            and not snapshot["num_waiting"]
        return (not self._batched or idle or len(self._kept_steps) >= FOLD_STEPS
                or time.monotonic() - self._kept_since >= FOLD_S)

    def _fold(self) -> None:
        """Fold what `on_engine_stats` kept into the metrics (under `_fold_lock`)."""
        steps, snapshot = self._kept_steps, self._kept_snapshot
        self._kept_steps, self._kept_snapshot = [], None
        self._fold_steps(steps)
        if snapshot is not None:
            self._on_snapshot(snapshot)

    def _fold_steps(self, step_stats: list) -> None:
        for s in step_stats:
            if s.engine_wide:
                self.batch_size.observe(s.batch_size)
                self.step_time.observe(s.step_time)
                self.scheduler_time.observe(s.scheduler_time)
                self.iteration_tokens.observe(s.num_tokens)
                self.prompt_tokens.inc(s.num_prefill_tokens)
            self.generation_tokens.inc(s.num_generation_tokens)
            for reason, m, n_prompt, n_gen in s.finished:
                self.success.labels(self.model_name, reason or "abort").inc()
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self.prompt_hist.observe(n_prompt)
                self.gen_hist.observe(n_gen)
                if m.lora_name is not None:
                    self.lora_success.labels(self.model_name, m.lora_name,
                                             reason or "abort").inc()
                    self.lora_generation_tokens.labels(self.model_name, m.lora_name).inc(n_gen)

    def _on_snapshot(self, snapshot: dict) -> None:
        self.running.set(snapshot["num_running"])
        self.waiting.set(snapshot["num_waiting"])
        self.swapped.set(snapshot["num_swapped"])
        self.kv_usage.set(snapshot["kv_cache_usage"])
        self.cpu_kv_usage.set(snapshot.get("cpu_kv_cache_usage", 0.0))
        if "prefill_budget" in snapshot:
            self.prefill_budget.set(snapshot["prefill_budget"])
        for term, value in zip(("base", "per_decode", "per_prefill_token"),
                               snapshot.get("step_cost", ())):
            if value is not None:
                self.step_cost.labels(self.model_name, term).set(value)
        if snapshot.get("spec_decode"):
            self._on_spec(snapshot["spec_decode"])
        if "lora" in snapshot:
            self._on_lora(snapshot["lora"])
        for key, value in snapshot["counters"].items():
            if key in self.scheduler_counters and value > self._last_counters[key]:
                self.scheduler_counters[key].inc(value - self._last_counters[key])
                self._last_counters[key] = value

    def _on_spec(self, spec: dict) -> None:
        last = self._last_spec
        for key, metric in self.spec_counters.items():
            if spec[key] > last[key]:
                metric.inc(spec[key] - last[key])
                last[key] = spec[key]
        per_pos = spec["accepted_per_pos"]
        for pos, value in enumerate(per_pos):
            seen = last["accepted_per_pos"][pos] if pos < len(last["accepted_per_pos"]) else 0
            child = self._spec_per_pos.labels(self.model_name, str(pos))
            if value > seen:
                child.inc(value - seen)
        last["accepted_per_pos"] = list(per_pos)
        self.spec_mean_k.set(spec["mean_k"])

    def render(self) -> bytes:
        """All metrics in Prometheus' text exposition format (with several API processes,
        theirs together)."""
        with self._fold_lock:
            self._fold()
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        for collector in self.collectors:
            registry.register(collector)
        return generate_latest(registry)


METRIC_NAMES = (
    "continuum_num_requests_running", "continuum_num_requests_waiting",
    "continuum_num_requests_swapped", "continuum_request_success_total",
    "continuum_time_to_first_token_seconds", "continuum_inter_token_latency_seconds",
    "continuum_e2e_request_latency_seconds", "continuum_request_queue_time_seconds",
    "continuum_request_prompt_tokens", "continuum_request_generation_tokens",
    "continuum_iteration_tokens_total", "continuum_prompt_tokens_total",
    "continuum_generation_tokens_total", "continuum_num_preemptions_total",
    "continuum_swap_in_blocks_total", "continuum_swap_out_blocks_total",
    "continuum_prefix_cache_queries_total", "continuum_prefix_cache_hits_total",
    "continuum_kv_cache_usage_perc", "continuum_cpu_kv_cache_usage_perc", "continuum_batch_size",
    "continuum_step_duration_seconds", "continuum_scheduler_overhead_seconds",
    "continuum_preemptions_by_mode_total", "continuum_prefill_budget_tokens",
    "continuum_cache_config_info",
)
SPEC_DECODE_METRIC_NAMES = (
    "continuum_spec_decode_num_drafts_total", "continuum_spec_decode_num_draft_tokens_total",
    "continuum_spec_decode_num_accepted_tokens_total",
    "continuum_spec_decode_num_accepted_tokens_per_pos_total", "continuum_spec_decode_mean_k",
)
