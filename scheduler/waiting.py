"""The scheduler's waiting state: requests that are not running, and the grammars some wait for.

Owns: a heap of (policy key, request) of the requests that may be admitted (new, or preempted
by recompute), and, aside, the requests whose structured-output grammar is still compiling
(WAITING_FOR_GRAMMAR, vLLM's WAITING_FOR_FSM) with the future of each compile. A compiled
request joins the heap under its own key, which never changes while it waits
(`scheduler.policy`), so it takes the place it would have held all along; the requests behind
it were admitted meanwhile, so one slow compile never stalls the others.

In: requests (`push`, `park` with their compile's future), `remove` for one that finishes.
Out: the head of the heap (`first`, `pop`); `compiled()`, the parked requests whose compile
ended (each moved to the heap if it succeeded). Both kinds count in `len()` and iteration
(`(key, request)` pairs), which the metrics and the queue bound read. The scheduler writes the
requests' statuses; this module only holds them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait

from scheduler.request import Request


class WaitingQueue:
    """See the module docstring. `key` is the policy's sort key (`policy_key`)."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self.key = key
        self.heap: list[tuple] = []                                # (key, request)
        self.parked: dict[str, tuple[Request, Future]] = {}        # waiting for their grammar

    def __len__(self) -> int:
        return len(self.heap) + len(self.parked)

    def __iter__(self) -> Iterator[tuple]:
        """(key, request) of every waiting request: the heap's, then the parked ones."""
        yield from self.heap
        for req, _ in self.parked.values():
            yield self.key(req), req

    def push(self, req: Request) -> None:
        """Queue `req` for admission in policy order."""
        heapq.heappush(self.heap, (self.key(req), req))

    def park(self, req: Request, grammar: Future) -> None:
        """Hold `req` aside until `grammar` (its compile) is done."""
        self.parked[req.request_id] = (req, grammar)

    def first(self) -> Request | None:
        """The next request to admit, None when none may be."""
        return self.heap[0][1] if self.heap else None

    def pop(self) -> Request:
        """Take the next request to admit out of the queue."""
        return heapq.heappop(self.heap)[1]

    def remove(self, req: Request) -> None:
        """Take `req` out wherever it waits (its compile goes on; nobody waits for it)."""
        if self.parked.pop(req.request_id, None) is None:
            self.heap = [e for e in self.heap if e[1] is not req]
            heapq.heapify(self.heap)

    def compiled(self) -> list[tuple[Request, BaseException | None]]:
        """The parked requests whose compile ended, with its exception (None: it compiled, and
        the request is in the heap now); they are parked no longer."""
        done = [(rid, req, grammar) for rid, (req, grammar) in self.parked.items()
                if grammar.done()]
        ended = []
        for rid, req, grammar in done:
            del self.parked[rid]
            error = grammar.exception()
            if error is None:
                self.push(req)
            ended.append((req, error))
        return ended

    def wait_for_grammar(self, timeout: float) -> None:
        """Block until a parked request's compile ends, or `timeout` seconds pass."""
        if self.parked:
            wait([g for _, g in self.parked.values()], timeout=timeout,
                 return_when=FIRST_COMPLETED)
