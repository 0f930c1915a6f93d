"""What the metrics read of the scheduler: its cumulative counters and its snapshot.

Owns: `SchedulerCounters` (cumulative since start, for Prometheus counters) and the shape of the
snapshot (`snapshot`): a plain dict, because it crosses the engine's pipe, whose keys
`api/metrics.py` (`Metrics.on_engine_stats`) reads. In: the scheduler's own values, from
`Scheduler.snapshot`; out: that dict. Pure data: no torch, no clocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    """Cumulative counters since start (for Prometheus counters). Tokens and blocks are counts."""

    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, tokens found cached
    num_preemptions: int = 0
    num_preemptions_swap: int = 0       # of those, by the mode actually used
    num_preemptions_recompute: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0


def snapshot(*, num_running: int, num_waiting: int, num_swapped: int, kv_cache_usage: float,
             cpu_kv_cache_usage: float, prefill_budget: int, counters: SchedulerCounters,
             spec_counters=None, step_cost: tuple | None = None) -> dict:
    """The snapshot's dict: request counts by state, the fractions of device and CPU KV blocks
    in use, the prefill budget (tokens), the counters as a dict, the speculative-decoding
    counters (`scheduler.spec_decode.SpecDecodeCounters`, None without speculation) as a dict,
    and, when given, the step-cost coefficients (base, per decode, per prefill token)."""
    out = {"num_running": num_running, "num_waiting": num_waiting, "num_swapped": num_swapped,
           "kv_cache_usage": kv_cache_usage, "cpu_kv_cache_usage": cpu_kv_cache_usage,
           "prefill_budget": prefill_budget, "counters": dataclasses.asdict(counters),
           "spec_decode": (dataclasses.asdict(spec_counters) if spec_counters is not None
                           else None)}
    if step_cost is not None:
        out["step_cost"] = step_cost
    return out
