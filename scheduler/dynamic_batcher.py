"""Triton's dynamic batcher as a pure decision: given the queue and the clock, a batch or a wait.

Owns: the request queue of one model (priority levels, per-level queue policy: `max_queue_size`,
queue timeouts with `REJECT` / `DELAY`) and `decide()`, the batch-forming rule. No threads, no
sleeps, no tensors: the caller (triton_compat's model runtime) holds the lock, calls `decide`
with the current time, runs the batch it returns or waits at most `wait_us`, and answers the
rejected requests. Pure Python, so every rule is tested without a server.

Behaviour follows Triton's documentation of `dynamic_batching` (model_configuration.md,
"Dynamic Batcher" and "Priority" / "Queue Policy"):
- requests are taken in priority order (lower level first, FCFS within a level; a request whose
  queue timeout passed under `DELAY` goes behind the level's requests that have not timed out);
- a batch grows along that order while the total batch size stays ≤ `max_batch_size` and the
  requests' shapes match (inputs with `allow_ragged_batch` are left out of the shape key);
- with `preferred_batch_size`, the largest preferred size that a prefix of that order forms
  is sent at once (so a long queue goes out in preferred sizes, never larger);
- else the batch is sent at once when it is full or cannot grow (next request too big or
  differently shaped);
- else it waits until the oldest request in it has waited `max_queue_delay_microseconds`,
  then the batch goes as it is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from scheduler.request import QueueFullError


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's `ModelQueuePolicy`. Times in microseconds; 0 = no timeout / unbounded queue."""

    timeout_action: str = "REJECT"              # "REJECT" or "DELAY"
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    def __post_init__(self) -> None:
        if self.timeout_action not in ("REJECT", "DELAY"):
            raise ValueError(f"timeout_action must be REJECT or DELAY, got {self.timeout_action}")


@dataclass(frozen=True)
class BatcherConfig:
    """What `decide` needs from a model's config. `dynamic=False` is Triton's default scheduler:
    one request per execution, in arrival order."""

    max_batch_size: int = 0                      # 0: the model has no batch dimension
    dynamic: bool = False
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    priority_levels: int = 0                     # 0: one level
    default_priority_level: int = 0
    default_policy: QueuePolicy = QueuePolicy()
    level_policies: dict = field(default_factory=dict)   # level -> QueuePolicy

    def policy(self, level: int) -> QueuePolicy:
        """The queue policy of priority `level` (its own, or the default one)."""
        return self.level_policies.get(level, self.default_policy)

    def level_of(self, priority: int) -> int:
        """Priority level of a request's `priority` parameter: 0, or a value past the model's
        levels, is the default level (Triton core's InferenceRequest::SetPriority)."""
        if priority == 0 or priority > self.priority_levels:
            return self.default_priority_level if self.priority_levels else 0
        return priority


@dataclass
class Pending:
    """One queued request as the batcher sees it. Times in microseconds of one clock."""

    key: object                  # the caller's handle for the request
    arrival_us: int
    batch_size: int              # rows along the batch dimension (1 for non-batching models)
    shape_key: tuple = ()        # requests with different keys never share a batch
    level: int = 0
    deadline_us: int | None = None   # queue timeout; None = none
    seq: int = 0                 # arrival order, set by the queue


@dataclass
class Decision:
    """`batch`: requests to execute now (in order) or empty; `rejected`: timed-out requests to
    answer with an error now; `wait_us`: how long to wait before deciding again (None: until
    the next arrival or the end of an execution)."""

    batch: list[Pending]
    rejected: list[Pending]
    wait_us: int | None


class RequestQueue:
    """The pending requests of one model, across priority levels. Not thread-safe."""

    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self.items: list[Pending] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.items)

    def timeout_us(self, level: int, requested_us: int | None) -> int:
        """The queue timeout of a request at `level`: its own when the policy allows it."""
        policy = self.config.policy(level)
        if requested_us is not None and policy.allow_timeout_override:
            return requested_us
        return policy.default_timeout_us

    def push(self, item: Pending) -> None:
        """Enqueue. Raises QueueFullError when the item's level is at `max_queue_size`."""
        limit = self.config.policy(item.level).max_queue_size
        if limit and sum(1 for p in self.items if p.level == item.level) >= limit:
            raise QueueFullError("Exceeds maximum queue size")
        item.seq = next(self._seq)
        self.items.append(item)

    def remove(self, items: list[Pending]) -> None:
        """Drop the given items (a batch taken or requests rejected)."""
        gone = {id(p) for p in items}
        self.items = [p for p in self.items if id(p) not in gone]


def decide(items: list[Pending], now_us: int, config: BatcherConfig,
           include: Callable[[Pending], bool] | None = None) -> Decision:
    """The batch-forming rule (module docstring). Pure: reads `items`, changes nothing.

    Args: `items` the queue (any order), `now_us` the current time, `config` the model's rule,
    `include` a model's custom batching rule (Triton's TRITONBACKEND_ModelBatchIncludeRequest),
    asked in order for each request that would join the batch: False ends the batch there
    and sends it at once (dynamic_batch_scheduler.cc); the first request always goes.
    Returns a `Decision`; the caller removes `batch` and `rejected` from the queue.
    """
    expired = [p for p in items if p.deadline_us is not None and now_us >= p.deadline_us]
    rejected = [p for p in expired if config.policy(p.level).timeout_action == "REJECT"]
    rejected_ids = {id(p) for p in rejected}
    delayed_ids = {id(p) for p in expired} - rejected_ids
    order = sorted((p for p in items if id(p) not in rejected_ids),
                   key=lambda p: (p.level, id(p) in delayed_ids, p.seq))
    if not order:
        return Decision([], rejected, None)
    if not config.dynamic:
        return Decision([order[0]], rejected, None)

    batch, size, blocked, prefix_len = [], 0, False, {}
    for p in order:
        if batch and (p.shape_key != batch[0].shape_key
                      or size + p.batch_size > config.max_batch_size):
            blocked = True
            break
        if include is not None and not include(p) and batch:
            blocked = True
            break
        batch.append(p)
        size += p.batch_size
        prefix_len[size] = len(batch)
    preferred = [s for s in config.preferred_batch_sizes if s in prefix_len]
    if preferred:
        return Decision(batch[:prefix_len[max(preferred)]], rejected, None)
    if blocked or size >= config.max_batch_size:
        return Decision(batch, rejected, None)
    waited = now_us - min(p.arrival_us for p in batch)
    if waited >= config.max_queue_delay_us:
        return Decision(batch, rejected, None)
    wait = config.max_queue_delay_us - waited
    deadlines = [p.deadline_us - now_us for p in order
                 if p.deadline_us is not None and id(p) not in delayed_ids]
    return Decision([], rejected, min([wait, *deadlines]))
