"""The scheduling policies: the order in which the scheduler keeps its requests.

Owns: one rule, `policy_key(config)`, the sort key of a `Request` under `config.policy`. The
scheduler keeps its waiting queue (a heap), its running list and its swapped list in that order;
it preempts from the back of the running list and admits from the front of the queue.

- `fcfs`: (arrival, admission sequence).
- `priority`: (priority, arrival, sequence); a lower priority value runs sooner.
- `sjf`: (arrival + aging x job, sequence), job = prompt tokens + `max_tokens` (else up to
  `max_model_len`). That key is linear aging (a job's rank improves by one token per
  `sjf_aging_ms_per_token` it waits) in a form that never changes while a request waits, so the
  heap stays valid. Bound: a request X is never passed over by a request that arrived more than
  aging x job(X) after X. The job is known at arrival and is the same when a preempted request
  is queued again (it recomputes its output as prompt); prefix-cache hits are not subtracted.

In: a validated `SchedulerConfig`. Out: a function of a `Request` (read only) to a tuple.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.config import SchedulerConfig
from scheduler.request import Request


def policy_key(config: SchedulerConfig) -> Callable[[Request], tuple]:
    """The sort key of `config.policy` ("fcfs", "priority" or "sjf"); smaller runs sooner."""
    if config.policy == "priority":
        return lambda r: (r.priority, r.arrival_time, r.seq)
    if config.policy == "sjf":
        aging_s, limit = config.sjf_aging_ms_per_token / 1000, config.max_model_len
        return lambda r: (r.arrival_time + aging_s * (
            r.num_prompt_tokens + (r.sampling_params.max_tokens or
                                   limit - r.num_prompt_tokens)), r.seq)
    return lambda r: (r.arrival_time, r.seq)
