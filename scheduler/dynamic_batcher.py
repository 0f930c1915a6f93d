"""Triton's dynamic batcher as a pure decision: given the queue and the clock, a batch or a wait.

Owns: the request queue of one model (priority levels, per-level queue policy: `max_queue_size`,
queue timeouts with `REJECT` / `DELAY`) and `decide()`, the batch-forming rule — as a pure
function over any list (the reference; the sequence batcher's heads) and as
`RequestQueue.decide`, the same rule over a queue kept in order, at the cost of one batch. No
threads, no sleeps, no tensors: the caller (triton_compat's model runtime) holds the lock, calls
`decide` with the current time, runs the batch it returns or waits at most `wait_us`, and
answers the rejected requests. Pure Python, so every rule is tested without a server.

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

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

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
    """The pending requests of one model, across priority levels, kept in the batcher's order
    so that a decision costs the batch it forms, not the queue's length (a burst of n requests
    drains in O(n log n), not O(n²)). Not thread-safe.

    Per level (lowest first): the requests that have not timed out, in arrival order, then
    those that timed out under `DELAY`, in arrival order. A request that timed out under
    `REJECT` leaves every batch and waits for the caller to answer and `remove` it. A heap of
    queue deadlines finds the timed-out requests; entries of requests already gone are dropped
    as they surface (and the heap is rebuilt when they outnumber the queue)."""

    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self._live: dict[int, dict[int, Pending]] = {}      # level -> seq -> request
        self._delayed: dict[int, dict[int, Pending]] = {}   # level -> seq -> timed out (DELAY)
        self._rejected: dict[int, Pending] = {}             # seq -> timed out (REJECT)
        self._deadlines: list[tuple[int, int, Pending]] = []   # heap of (deadline_us, seq, p)
        self._per_level: dict[int, int] = {}
        self._len = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._len

    @property
    def items(self) -> list[Pending]:
        """Every queued request: the batcher's order, then the timed-out `REJECT` ones. O(n),
        for inspection; the batcher itself reads the queue through `decide`."""
        return [*self._ordered(), *self._rejected.values()]

    def timeout_us(self, level: int, requested_us: int | None) -> int:
        """The queue timeout of a request at `level`: its own when the policy allows it."""
        policy = self.config.policy(level)
        if requested_us is not None and policy.allow_timeout_override:
            return requested_us
        return policy.default_timeout_us

    def push(self, item: Pending) -> None:
        """Enqueue. Raises QueueFullError when the item's level is at `max_queue_size`."""
        level = item.level
        limit = self.config.policy(level).max_queue_size
        if limit and self._per_level.get(level, 0) >= limit:
            raise QueueFullError("Exceeds maximum queue size")
        item.seq = next(self._seq)
        self._live.setdefault(level, {})[item.seq] = item
        self._per_level[level] = self._per_level.get(level, 0) + 1
        self._len += 1
        if item.deadline_us is not None:
            heapq.heappush(self._deadlines, (item.deadline_us, item.seq, item))

    def remove(self, items: list[Pending]) -> None:
        """Drop the given items (a batch taken or requests rejected); others are ignored."""
        for p in items:
            for where in (self._live.get(p.level), self._delayed.get(p.level), self._rejected):
                if where is not None and where.get(p.seq) is p:
                    del where[p.seq]
                    self._per_level[p.level] -= 1
                    self._len -= 1
                    break
        if len(self._deadlines) > 2 * self._len + 64:
            self._deadlines = [e for e in self._deadlines if self._waiting(e[2])]
            heapq.heapify(self._deadlines)

    def decide(self, now_us: int, include: Callable[[Pending], bool] | None = None) -> Decision:
        """`decide(self.items, now_us, self.config, include)`, the same Decision, at the cost
        of the batch it forms plus the requests that timed out since the last call. The
        caller removes `batch` and `rejected`."""
        self._expire(now_us)
        return _form(self._ordered(), list(self._rejected.values()), now_us, self.config,
                     include, self.next_deadline_us)

    def next_deadline_us(self) -> int | None:
        """The earliest queue deadline among requests that have not timed out, or None."""
        heap = self._deadlines
        while heap and not self._waiting(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _waiting(self, p: Pending) -> bool:
        """Whether `p` is queued and has not timed out."""
        live = self._live.get(p.level)
        return live is not None and live.get(p.seq) is p

    def _expire(self, now_us: int) -> None:
        """Move the requests whose deadline passed by `now_us` behind their level (`DELAY`)
        or out of every batch (`REJECT`)."""
        heap = self._deadlines
        while heap and heap[0][0] <= now_us:
            _, seq, p = heapq.heappop(heap)
            if not self._waiting(p):
                continue
            del self._live[p.level][seq]
            if self.config.policy(p.level).timeout_action == "REJECT":
                self._rejected[seq] = p
                continue
            delayed = self._delayed.setdefault(p.level, {})
            in_order = not delayed or seq > next(reversed(delayed))
            delayed[seq] = p
            if not in_order:       # an earlier arrival timed out later (its own timeout)
                self._delayed[p.level] = dict(sorted(delayed.items()))

    def _ordered(self) -> Iterator[Pending]:
        """The queue in the batcher's order (the class docstring), lazily."""
        for level in sorted(self._live.keys() | self._delayed.keys()):
            yield from self._live.get(level, {}).values()
            yield from self._delayed.get(level, {}).values()


def decide(items: list[Pending], now_us: int, config: BatcherConfig,
           include: Callable[[Pending], bool] | None = None) -> Decision:
    """The batch-forming rule (module docstring). Pure: reads `items`, changes nothing; O(n log
    n) in the queue's length (`RequestQueue.decide` is the same rule at the cost of a batch).

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

    def next_deadline() -> int | None:
        return min((p.deadline_us for p in order
                    if p.deadline_us is not None and id(p) not in delayed_ids), default=None)

    return _form(iter(order), rejected, now_us, config, include, next_deadline)


def _form(order: Iterator[Pending], rejected: list[Pending], now_us: int, config: BatcherConfig,
          include: Callable[[Pending], bool] | None,
          next_deadline: Callable[[], int | None]) -> Decision:
    """The rule past the ordering: the batch a prefix of `order` forms, or how long to wait
    (the queue delay, cut short by `next_deadline()`, the earliest queue timeout to come)."""
    first = next(order, None)
    if first is None:
        return Decision([], rejected, None)
    if not config.dynamic:
        return Decision([first], rejected, None)
    batch, size, blocked, prefix_len = [], 0, False, {}
    for p in itertools.chain((first,), order):
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
    deadline = next_deadline()
    return Decision([], rejected, wait if deadline is None else min(wait, deadline - now_us))
