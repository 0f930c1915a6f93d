"""Triton's sequence batcher as a pure decision: sequence slots, the backlog, idle sequences.

Owns: which batch slot of which model instance each sequence (correlation id) holds, the FIFO
backlog of sequences waiting for a slot, the requests queued per slot, and the two batch rules:
- `direct`: each instance has max(1, max_batch_size) slots; a batch is the head request of
  every slot from slot 0 up to the highest slot with a request, the slots between without one
  (or with a differently shaped one) filled by padding (`None`, READY = false for the model);
  with `max_queue_delay_microseconds` and `minimum_slot_utilization` the batch waits until
  enough slots are ready or its oldest request has waited the delay.
- `oldest`: each instance has `max_candidate_sequences` slots; the head requests of its slots
  go through the dynamic batcher's rule (`scheduler.dynamic_batcher.decide`: oldest first,
  `preferred_batch_size`, `max_queue_delay_microseconds`); no padding.
A slot's requests run one at a time (the caller runs one batch per instance at a time), so at
most one request per sequence is in flight. A sequence that sends nothing for
`max_sequence_idle_microseconds` loses its slot; a backlogged sequence whose request `timeout`
passes is rejected whole. No threads, tensors or clocks here: the caller (triton_compat's
sequence runtime) holds the lock and passes the time in microseconds.

Reference: Triton core `src/sequence_batch_scheduler/sequence_batch_scheduler.cc` (Enqueue,
ReleaseSequenceSlot, ReaperThread, DirectSequenceBatch / OldestSequenceBatch) and
server `docs/user_guide/architecture.md` "Stateful Models".
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from scheduler.dynamic_batcher import BatcherConfig, Pending, decide

_RELEASE = None        # a slot-queue marker left by the reaper: the sequence went idle
_BACKLOG_IDLE_US = 50_000   # Triton re-checks an idle sequence still in the backlog this often


class SequenceError(Exception):
    """A request the batcher refuses (Triton's INVALID_ARG): not started, unknown id."""


@dataclass(frozen=True)
class SequenceConfig:
    """What the batcher needs from `sequence_batching`. Times in microseconds."""

    strategy: str = "direct"                    # "direct" or "oldest"
    instances: int = 1
    slots: int = 1                               # per instance
    max_batch_size: int = 0                      # the model's (0: no batch dimension)
    max_queue_delay_us: int = 0
    minimum_slot_utilization: float = 0.0        # direct only
    preferred_batch_sizes: tuple[int, ...] = ()  # oldest only
    max_sequence_idle_us: int = 1_000_000
    model: str = ""                              # for error texts

    def __post_init__(self) -> None:
        if self.strategy not in ("direct", "oldest"):
            raise ValueError(f"strategy must be direct or oldest, got {self.strategy}")


@dataclass
class SeqItem:
    """One request of a sequence as the batcher sees it. `shape_key`: requests with different
    keys never share a batch (shapes of the inputs that do not allow ragged batching)."""

    key: object                  # the caller's handle for the request
    corrid: int | str
    start: bool
    end: bool
    arrival_us: int
    shape_key: tuple = ()
    seq: int = 0                 # arrival order, set by `enqueue`


@dataclass
class Slot:
    """One batch slot of one instance: the sequence it holds (None: free) and its queue."""

    instance: int
    index: int
    corrid: int | str | None = None
    queue: deque = field(default_factory=deque)


@dataclass
class _Backlog:
    corrid: int | str
    items: deque
    expires_us: int | None = None


class SequenceBatcher:
    """Slots, backlog and batch decisions for one model (module docstring). Not
    thread-safe: the caller holds its lock around every call."""

    def __init__(self, config: SequenceConfig) -> None:
        self.config = config
        self.slots = [[Slot(i, s) for s in range(config.slots)]
                      for i in range(config.instances)]
        self._free = [(s, i) for i in range(config.instances) for s in range(config.slots)]
        heapq.heapify(self._free)                # lowest slot index first, as Triton
        self._by_id: dict = {}                   # corrid -> Slot (until its END is queued)
        self._backlog_by_id: dict = {}           # corrid -> _Backlog still collecting
        self._backlogs: deque[_Backlog] = deque()
        self._last_us: dict = {}                 # corrid -> time of its last request
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Requests waiting: queued in slots or in the backlog."""
        return sum(self.waiting())

    def waiting(self) -> tuple[int, int]:
        """(requests queued in slots, requests in the backlog)."""
        return (sum(len(s.queue) for row in self.slots for s in row),
                sum(len(b.items) for b in self._backlogs))

    def enqueue(self, item: SeqItem, now_us: int, timeout_us: int = 0) -> Slot | None:
        """Queue `item` in its sequence's slot, or in the backlog when no slot is free (then
        None is returned). A START on a running id continues in that slot (Triton: the old
        sequence ends early). `timeout_us` (0: none) bounds a backlogged sequence's wait.

        Raises SequenceError for a request without START whose sequence is unknown (never
        started, ended, or dropped as idle)."""
        corrid = item.corrid
        slot = self._by_id.get(corrid)
        backlog = self._backlog_by_id.get(corrid)
        if not item.start and slot is None and backlog is None:
            raise SequenceError(f"inference request for sequence {corrid} to model "
                                f"'{self.config.model}' must specify the START flag on the "
                                "first request of the sequence")
        item.seq = next(self._seq)
        self._last_us[corrid] = now_us
        if slot is None and backlog is None and self._free:
            index, instance = heapq.heappop(self._free)
            slot = self.slots[instance][index]
            slot.corrid = corrid
            self._by_id[corrid] = slot
        if slot is None:
            if backlog is None:
                backlog = _Backlog(corrid, deque())
                self._backlogs.append(backlog)
                self._backlog_by_id[corrid] = backlog
            if timeout_us:
                expires = now_us + timeout_us
                backlog.expires_us = min(backlog.expires_us or expires, expires)
            backlog.items.append(item)
            if item.end:
                del self._backlog_by_id[corrid]
            return None
        slot.queue.append(item)
        if item.end:
            del self._by_id[corrid]
        return slot

    def finish(self, corrid: int | str) -> int | None:
        """End a sequence that has no END request (an iterative sequence whose model stopped
        rescheduling it): its slot is freed once the requests queued before now are taken.
        Returns the slot's instance, or None when the id holds no slot."""
        slot = self._by_id.pop(corrid, None)
        self._last_us.pop(corrid, None)
        if slot is None:
            return None
        slot.queue.append(_RELEASE)
        return slot.instance

    def next_batch(self, instance: int, now_us: int
                   ) -> tuple[list[tuple[Slot, SeqItem | None]], int | None]:
        """The batch instance `instance` runs now, as (slot, request or None for padding) in
        slot order, taken off the queues; or ([], wait_us): decide again after `wait_us`
        (None: at the next arrival)."""
        slots = self.slots[instance]
        for s in slots:
            while s.queue and s.queue[0] is _RELEASE:
                s.queue.popleft()
                self._release(s)
        ready = [s for s in slots if s.queue]
        if not ready:
            return [], None
        if self.config.strategy == "oldest":
            return self._oldest(ready, now_us)
        cfg = self.config
        if cfg.max_queue_delay_us and cfg.minimum_slot_utilization:
            waited = now_us - min(s.queue[0].arrival_us for s in ready)
            if waited <= cfg.max_queue_delay_us and \
                    len(ready) / cfg.slots < cfg.minimum_slot_utilization:
                return [], cfg.max_queue_delay_us - waited + 1
        shape = ready[0].queue[0].shape_key
        entries = []
        for s in slots[:ready[-1].index + 1]:
            item = s.queue[0] if s.queue and s.queue[0].shape_key == shape else None
            if item is not None:
                self._take(s)
            entries.append((s, item))
        return entries, None

    def _oldest(self, ready: list[Slot], now_us: int):
        cfg = self.config
        rule = BatcherConfig(max_batch_size=max(1, cfg.max_batch_size),
                             dynamic=cfg.max_batch_size > 0,
                             preferred_batch_sizes=cfg.preferred_batch_sizes,
                             max_queue_delay_us=cfg.max_queue_delay_us)
        heads = [Pending(s, s.queue[0].arrival_us, 1, s.queue[0].shape_key,
                         seq=s.queue[0].seq) for s in ready]
        decision = decide(heads, now_us, rule)
        if not decision.batch:
            return [], decision.wait_us
        return [(p.key, self._take(p.key)) for p in decision.batch], None

    def _take(self, slot: Slot) -> SeqItem:
        item = slot.queue.popleft()
        if item.end:
            self._release(slot)
        return item

    def _release(self, slot: Slot) -> None:
        """Free `slot`, or hand it to the oldest backlogged sequence (Triton's
        ReleaseSequenceSlot)."""
        slot.corrid = None
        while self._backlogs:
            backlog = self._backlogs.popleft()
            if not backlog.items:
                continue
            if not backlog.items[-1].end:       # still collecting: later requests go here
                self._backlog_by_id.pop(backlog.corrid, None)
                self._by_id[backlog.corrid] = slot
            slot.corrid = backlog.corrid
            slot.queue.extend(backlog.items)
            return
        heapq.heappush(self._free, (slot.index, slot.instance))

    def reap(self, now_us: int) -> tuple[list[SeqItem], set[int], int | None]:
        """Drop idle sequences and expired backlogs (Triton's ReaperThread).

        Returns (requests to reject with "timeout of the corresponding sequence has been
        expired", instances whose slots changed, microseconds until the next check or None)."""
        idle = self.config.max_sequence_idle_us
        wait, touched = None, set()
        for corrid, last in list(self._last_us.items()):
            remaining = idle - (now_us - last)
            if remaining > 0:
                wait = remaining if wait is None else min(wait, remaining)
                continue
            slot = self._by_id.pop(corrid, None)
            if slot is not None:                 # released when the marker reaches the head
                slot.queue.append(_RELEASE)
                touched.add(slot.instance)
                del self._last_us[corrid]
            elif corrid in self._backlog_by_id:
                wait = _BACKLOG_IDLE_US if wait is None else min(wait, _BACKLOG_IDLE_US)
            else:
                del self._last_us[corrid]
        rejected = []
        for backlog in list(self._backlogs):
            if backlog.expires_us is None:
                continue
            if backlog.expires_us <= now_us:
                self._backlogs.remove(backlog)
                if self._backlog_by_id.get(backlog.corrid) is backlog:
                    del self._backlog_by_id[backlog.corrid]
                rejected.extend(backlog.items)
            else:
                left = backlog.expires_us - now_us
                wait = left if wait is None else min(wait, left)
        return rejected, touched, wait
