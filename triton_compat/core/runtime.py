"""One loaded model version: request validation, its queue and batcher thread, its instances.

Data flow: a front end hands a decoded request to `ModelRuntime.submit`, which validates it
against the config (Triton's error texts), queues it and returns a `concurrent.futures.Future`.
One batcher thread per model holds the lock, asks its `scheduler.dynamic_batcher.RequestQueue`
to `decide` a batch whenever an instance is idle (or a timeout or the queue delay expires), and
hands the batch to that instance's worker thread; the worker executes it on the backend, records
the statistics, resolves each request's future with its outputs or its own error, and then runs
the next batch the batcher would dispatch at once itself (no batcher wake-up between batches).
A model cheaper than a thread hand-off (`runs_inline`) runs on the event loop that received
its requests instead: at once when alone, else its batches at the end of the loop's pass
(`_drain`). `instance_group` count N = N instances = N batches in flight. With
`preserve_ordering`, the futures of a batch are resolved only after those of every earlier batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scheduler.dynamic_batcher import Pending, QueueFullError, RequestQueue
from scheduler.futures import Resolved, settle
from triton_compat.core import batch_strategy, pb_types
from triton_compat.core.backends import BackendRequest
from triton_compat.core.backends.factory import create_instance
from triton_compat.core.config import batcher_config
from triton_compat.errors import DECOUPLED_HTTP, InferError
from triton_compat.core.sequence.spec import sequence_params
from triton_compat.core.stats import ModelStats
from triton_compat.core.validate import Signature, check_inputs, check_outputs, check_result


logger = logging.getLogger("continuum.triton")
VALID_CACHE_SIZE = 256      # request shapes whose checks `_validate` remembers
# Triton core's text (infer_request.cc) for a request a model asked to run again when the model
# is not an iterative sequence model
RESCHEDULE_REFUSED = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while "
                      "the model is not configured to handle such a flag.")
# A model whose executions average at most this (wall time, µs, per request in the batch) runs
# on the event loop when an instance is idle: handing it to a worker thread and the result back
# costs more (measured on `simple`: two thread hand-offs ≈ 100–150 µs of latency against ≈ 30 µs
# of execute). Per request, since a batch of a cheap model is still cheaper run there: `simple`
# with dynamic batching takes ~290 µs a batch of 4-8 at perf_analyzer c16, and counting the
# batch against this bound put every batch on a worker thread at half the rate.
INLINE_MAX_US = 200.0
EXEC_EWMA_WEIGHT = 0.2       # weight of the newest execution in `exec_us`
# A model two of whose executions within INLINE_BAN_WINDOW took this long (µs) never runs on
# the event loop again: its cost varies with its input, and a slow execution there stalls every
# other request. One alone only lifts the average (`exec_us`) over INLINE_MAX_US for a while: a
# cheap model sees such a stall now and then from its host (preemption, a garbage collection),
# and banning it for one halved `simple`'s throughput for good.
INLINE_BAN_US = 5_000.0
INLINE_BAN_WINDOW = 100      # executions
# A cheap model's batch that must wait at most this long (µs: its queue delay, or its instance
# busy on another thread) keeps waiting on the event loop that queued it (`_drain`), so that it
# runs there too; longer waits go to the batcher thread.
LOOP_WAIT_US = 1_000


def _bounded(fn, timeout_s: float) -> bool:
    """Run `fn()` on a daemon thread; whether it ended within `timeout_s` seconds (a model's
    stuck `finalize` must not hold a server's shutdown)."""
    thread = threading.Thread(target=fn, name="triton-finalize", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    return not thread.is_alive()


class _Settled:
    """A request's future is done: it leaves `inflight`, and if its caller cancelled it (the
    HTTP client went away) the request is cancelled for the model too
    (`InferenceRequest.is_cancelled()`). One callback object for both: it runs per request."""

    __slots__ = ("inflight", "request")

    def __init__(self, inflight: set, request: BackendRequest) -> None:
        self.inflight, self.request = inflight, request

    def __call__(self, future: Future) -> None:
        self.inflight.discard(future)
        if future.cancelled():
            self.request.cancelled = True


def _now_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass
class Job:
    """A queued request: what to run, where its answer goes, when it arrived (ns,
    `time.perf_counter_ns`)."""

    request: BackendRequest
    future: Future | Resolved       # Resolved: run inline, settled before submit returns
    enqueued_ns: int


class ModelRuntime:
    """A loaded, servable model version with its batcher and instances.

    Raises InferError(500) from the constructor when an instance fails to load."""

    def __init__(self, config, model_dir: Path, version: int) -> None:
        self.config, self.version = config, version
        self.signature = Signature(config)
        self.decoupled = config.model_transaction_policy.decoupled
        self.batcher = batcher_config(config)
        self.strategy = batch_strategy.load(config, model_dir, version)
        self.ragged = {t.name for t in config.input if t.allow_ragged_batch}
        self.queue = RequestQueue(self.batcher)
        self.stats = ModelStats()
        self.cond = threading.Condition()
        self.instances = []
        try:
            for group in config.instance_group:
                for i in range(group.count):   # Triton's names: `<group>_<i>`
                    self.instances.append(create_instance(config, model_dir, version,
                                                          f"{group.name}_{i}"))
        except Exception:
            for inst in self.instances:
                inst.close()
            raise
        self.idle = list(self.instances)
        # `decide` sends a request that finds the queue empty alone and at once: no dynamic
        # batcher (Triton's default scheduler), or no queue delay to wait, and no custom
        # batching rule to ask (submit then skips the queue)
        self._lone_at_once = self.strategy is None and (
            not self.batcher.dynamic or self.batcher.max_queue_delay_us == 0)
        self.executing = 0
        self.pool = ThreadPoolExecutor(len(self.instances),
                                       thread_name_prefix=f"triton-{config.name}")
        self.preserve = config.dynamic_batching.preserve_ordering
        self._batch_seq = self._release_seq = 0      # batches dispatched / released in order
        self._done: dict[int, list] = {}             # preserve_ordering: finished, not released
        self.stopping = False
        self.exec_us: float | None = None     # moving average of execute time a request, µs
        self.inline_banned = False            # two executions took over INLINE_BAN_US
        self._slow_at = -INLINE_BAN_WINDOW - 1   # stats.execution_count at the last slow one
        self._drain_pending = False           # a `_drain` is queued on an event loop ...
        self._drain_loop = None               # ... this one (its `call_soon`)
        self.inflight: set[Future] = set()    # futures of requests not answered yet
        self._valid: dict[tuple, tuple] = {}  # `_validate`'s answers by request shape
        self.thread = threading.Thread(target=self._loop, name=f"batcher-{config.name}",
                                       daemon=True)
        self.thread.start()

    @property
    def runs_inline(self) -> bool:
        """Whether an event-loop caller should pass `submit(inline=True)`: the model is not
        decoupled (its execute may send responses over time), has run, its executions average
        at most INLINE_MAX_US a request and no two within INLINE_BAN_WINDOW took
        INLINE_BAN_US. False until the first execution has been timed, so a slow model never
        blocks the loop by default."""
        return self.exec_us is not None and self.exec_us <= INLINE_MAX_US and \
            not self.decoupled and not self.inline_banned

    @property
    def runs_alone(self) -> bool:
        """Every request runs in an execution of its own (no dynamic batcher: Triton's default
        scheduler), so a request that arrives with others gains nothing by waiting for them."""
        return not self.batcher.dynamic

    async def generate(self, inputs: dict, request_id: str = "", datatypes: dict | None = None,
                       parameters: dict | None = None):
        """A decoupled model's responses to one request, as they are sent: (outputs or None,
        final); the last has final True (outputs None for a flag-only final). Raises
        InferError: a bad request, the model's error response, or its execute failing."""
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()

        def deliver(result, final: bool) -> None:
            loop.call_soon_threadsafe(responses.put_nowait, (result, final))

        request = BackendRequest(inputs, [], request_id, parameters or {}, deliver)
        try:
            future = self.submit(request, datatypes)
        except InferError as e:
            e.refused = True
            raise
        def on_done(f: Future) -> None:     # execute failed or never ran: end the stream
            if f.cancelled():
                deliver(InferError("the request was cancelled", 500), True)
            elif f.exception() is not None:
                deliver(f.exception(), True)

        future.add_done_callback(on_done)
        final = False
        try:
            while True:
                result, final = await responses.get()
                if isinstance(result, Exception):
                    raise result if isinstance(result, InferError) else \
                        InferError(f"{type(result).__name__}: {result}", 500)
                yield result, final
                if final:
                    return
        finally:          # the client went away before the end: is_cancelled() says so
            request.cancelled = request.cancelled or not final

    @property
    def pending_count(self) -> int:
        """Requests queued or executing (Triton's nv_inference_pending_request_count)."""
        return len(self.queue) + self.executing

    def submit(self, request: BackendRequest, datatypes: dict[str, str] | None = None,
               priority: int = 0, timeout_us: int | None = None,
               inline: bool = False, defer=None) -> Future:
        """Validate and queue `request`; the future resolves to {output name: array}.

        `inline`: the caller runs the batch itself when one is ready at once and an instance
        is idle: the future is then resolved on return, with no hand-off to the instance's
        thread. For a thread that may block (a gRPC worker), or the event loop when
        `runs_inline` says the model is cheap and the request is alone.
        `defer`: the event loop, for a cheap model with a dynamic batcher: without `inline`
        (other requests are arriving) the batch runs on the loop at the end of this pass
        (`_drain`), so the requests that arrived together queue first and run as one batch,
        as Triton's batcher forms them; with `inline`, a batch that cannot run at once waits
        on the loop the same way.
        Raises InferError: 400 for a bad request or priority, 503 when the queue is full or
        the model is being unloaded."""
        batch_size, shape_key = self._validate(request, datatypes)
        if "sequence_id" in request.parameters:     # Triton passes them to any model
            request.correlation_id, request.flags = sequence_params(request.parameters)
        level = self.batcher.level_of(priority)
        now = _now_us()
        timeout = self.queue.timeout_us(level, timeout_us) if self.batcher.dynamic else 0
        queued = Job(request, None, time.perf_counter_ns())
        item = Pending(queued, now, batch_size, shape_key, level, now + timeout if timeout else None)
        if request.trace is not None:       # the trace extension: QUEUE_START
            request.trace.queued(request.inputs, datatypes or {}, pb_types.wire_datatype)
        with self.cond:
            if self.stopping:
                raise InferError(f"model '{self.config.name}' is being unloaded", 503)
            if inline and self._lone_at_once and self.idle and not self.queue:
                # answered before this call returns (with preserve_ordering, only once every
                # earlier batch is: a Future there): never cancelled, never in `inflight`
                future = queued.future = Future() if self.preserve else Resolved()
                job = self._claim([item])    # what `decide` answers for a lone request
            else:
                future = queued.future = Future()
                self.inflight.add(future)
                future.add_done_callback(_Settled(self.inflight, request))
                try:
                    self.queue.push(item)
                except QueueFullError as e:   # not a failure in Triton's statistics
                    raise InferError(f"[request id: {request.id or '<id_unknown>'}] {e}",
                                     503) from None
                job = None if defer is not None and not inline else self._claim_ready(now)
                if job is None and defer is not None:   # at the end of this loop pass
                    if not self._drain_pending:
                        self._drain_pending, self._drain_loop = True, defer
                        defer.call_soon(self._drain)
                    return future
            if job and not inline:
                self.pool.submit(self._work, *job)
            if not job or self.queue:
                self.cond.notify()
        if job and inline:                # run the batch on this thread
            self._execute(*job)
        return future

    def _drain(self) -> None:
        """On the event loop, at the end of a pass: run the batches the requests of the pass
        form, one after the other while they are ready and an instance is idle (a model
        without dynamic batching runs them one per execution). A batch that must wait up to
        LOOP_WAIT_US (its queue delay; its instance finishing a batch on another thread)
        waits here, the drain queued again for the end of the next pass: it then runs on this
        loop, as the requests after it will (the batcher thread and the worker chain leave
        the queue to a pending drain). Handing each batch to them instead costs two thread
        wake-ups and the GIL passed back and forth a batch: that halved `simple`'s rate
        with dynamic batching at perf_analyzer c16. The batcher thread takes longer waits."""
        while True:
            with self.cond:
                job, stay = self._loop_job(_now_us())
                if job is None:
                    if stay:
                        self._drain_loop.call_soon(self._drain)
                        return
                    self._drain_pending = False
                    if self.queue:
                        self.cond.notify()
                    return
            self._execute(*job)

    def _loop_job(self, now_us: int) -> tuple[tuple | None, bool]:
        """`_drain`'s step: (the batch to run now, claimed, or None; whether to wait on the
        loop for it). Caller holds the lock."""
        if self.inline_banned:
            return None, False
        job, decision = self._ready(now_us)
        if job is not None or not self.runs_inline or self.stopping:
            return job, False
        if decision is None:                  # another thread ends a (cheap) batch
            return None, bool(self.queue)
        # timed-out requests: the batcher thread answers them
        return None, not decision.rejected and decision.wait_us is not None and \
            decision.wait_us <= LOOP_WAIT_US

    def _validate(self, request: BackendRequest,
                  datatypes: dict[str, str] | None) -> tuple[int, tuple]:
        """Triton's request checks (decoupled over one-response inference, inputs, outputs);
        fills in `request.outputs`. Returns the batch size and `_shape_key`. Raises
        InferError.

        The checks read only the inputs' names, shapes and datatypes and the outputs' names:
        the answer for a request like one seen before (a client repeating one request shape)
        is remembered (up to VALID_CACHE_SIZE shapes; failures are not)."""
        if self.decoupled and request.deliver is None:
            raise InferError(DECOUPLED_HTTP, 501)
        datatypes = datatypes or {}
        names = request.outputs or None
        key = (tuple([(n, a.shape, datatypes.get(n)) for n, a in request.inputs.items()]),
               None if names is None else tuple(names))
        known = self._valid.get(key)
        if known is None:
            outputs = check_outputs(self.signature, names)
            batch_size = check_inputs(self.signature, request.inputs, datatypes, request.id)
            if len(self._valid) >= VALID_CACHE_SIZE:
                self._valid.clear()
            known = self._valid[key] = (batch_size, self._shape_key(request.inputs), outputs)
        request.outputs = list(known[2])
        return known[0], known[1]

    def _shape_key(self, inputs: dict[str, np.ndarray]) -> tuple:
        """Requests with different keys never share a batch: the shapes past the batch
        dimension of the inputs that do not allow ragged batching (() without batching)."""
        if self.config.max_batch_size == 0:
            return ()
        return tuple((n, a.shape[1:]) for n, a in sorted(inputs.items()) if n not in self.ragged)

    def _claim_ready(self, now_us: int) -> tuple | None:
        """The batcher's decision taken on the caller's thread (a submitter, or a worker whose
        execution just ended): when an instance is idle and a batch is ready at once (no queue
        delay to wait out, nothing timed out), the batch taken off the queue and claimed
        (`_claim`'s tuple); else None and the batcher thread decides. The same decision the
        batcher thread would take, minus waking it (one thread hand-off saved). Caller holds
        the lock."""
        return self._ready(now_us)[0]

    def _ready(self, now_us: int) -> tuple:
        """`_claim_ready`'s answer and the decision behind it: (the claimed job or None, the
        `Decision`, None when no instance is idle). Caller holds the lock."""
        if not self.idle:
            return None, None
        decision = self._decide(now_us)
        if not decision.batch or decision.rejected:
            return None, decision
        self.queue.remove(decision.batch)
        return self._claim(decision.batch), decision

    def _loop(self) -> None:
        with self.cond:
            while not (self.stopping and not self.queue):
                decision = self._decide(_now_us())
                self.queue.remove(decision.rejected)
                for p in decision.rejected:
                    self._fail(p, InferError("Request timeout expired", 503))
                wait = decision.wait_us
                owned = self._drain_pending and not self.stopping    # a loop runs them
                if decision.batch and self.idle and not owned:
                    self.queue.remove(decision.batch)
                    self._dispatch(decision.batch)
                    continue
                if decision.batch or owned:  # every instance busy, or a loop's drain
                    deadline = self.queue.next_deadline_us()
                    wait = None if deadline is None else deadline - _now_us()
                self.cond.wait(None if wait is None else max(wait, 0) / 1e6)

    def _decide(self, now_us: int):
        """`decide` on the queue, with the model's custom batching rule if it has one."""
        if self.strategy is None:
            return self.queue.decide(now_us)
        with self.strategy.batch() as include:
            return self.queue.decide(now_us, include)

    def _claim(self, batch: list[Pending]) -> tuple:
        """(idle instance, batch, batch sequence number) for `_execute`. Caller holds the
        lock."""
        instance = self.idle.pop()
        seq, self._batch_seq = self._batch_seq, self._batch_seq + 1
        self.executing += len(batch)
        return instance, batch, seq

    def _dispatch(self, batch: list[Pending]) -> None:
        self.pool.submit(self._work, *self._claim(batch))

    def _work(self, instance, batch: list[Pending], seq: int) -> None:
        """An instance's worker thread: execute the batch, then every batch that is ready at
        once when it ends. The next batch starts on this thread right after the results are
        handed back, with no wake-up of the batcher thread and no hand-off to the pool: those
        cost ~1 ms between batches under load (measured on `content_type` at concurrency 4,
        each thread waiting for the GIL while the event loop sends the last batch's answers),
        and the instance idled through them."""
        job = (instance, batch, seq)
        while job is not None:
            job = self._execute(*job, chain=True)

    def _execute(self, instance, batch: list[Pending], seq: int,
                 chain: bool = False) -> tuple | None:
        """Run `batch` on `instance` and resolve its futures; with `chain`, claim and return
        the next batch for the same instance when one is ready at once (see `_complete`)."""
        jobs = [p.key for p in batch]
        requests = [j.request for j in jobs]
        start = time.perf_counter_ns()
        try:
            results, times = instance.execute(requests)
        except Exception as e:       # a backend bug: fail this batch only
            results, times = [InferError(f"{type(e).__name__}: {e}", 500)] * len(batch), None
        traced = [r.trace for r in requests if r.trace is not None]
        if traced:                          # the trace extension: the compute times
            end = time.perf_counter_ns()
            for trace in traced:
                trace.computed(start, times, end)
        results = list(results)
        checked = not self.decoupled        # decoupled responses went through their senders
        for i, (p, request) in enumerate(zip(batch, requests)):
            if request.reschedule:
                results[i] = InferError(RESCHEDULE_REFUSED)
            elif checked:
                results[i] = check_result(self.signature, request.outputs, results[i],
                                          p.batch_size)
        end = time.perf_counter_ns()
        self.stats.record_execution([j.enqueued_ns for j in jobs],
                                    [p.batch_size for p in batch], results, start, end, times)
        took = (end - start) / 1000
        each = took / len(batch)
        self.exec_us = each if self.exec_us is None else \
            self.exec_us + EXEC_EWMA_WEIGHT * (each - self.exec_us)
        if took > INLINE_BAN_US:                   # counted just above, in record_execution
            count = self.stats.execution_count
            if count - self._slow_at <= INLINE_BAN_WINDOW:
                self.inline_banned = True
            self._slow_at = count
        return self._complete(instance, list(zip(jobs, results)), seq, chain)

    def _complete(self, instance, ready: list[tuple[Job, object]], seq: int,
                  chain: bool = False) -> tuple | None:
        """An execution ended: its instance is idle again and each job's future gets its
        result, in batch order after every earlier batch with `preserve_ordering`. With
        `chain`: the batch the batcher would dispatch now, if one is ready at once, claimed
        for the caller's thread (`_claim`'s tuple), else None."""
        job = None
        with self.cond:
            self.idle.append(instance)
            self.executing -= len(ready)
            if self.preserve:        # release this batch only after every earlier one
                self._done[seq] = ready
                ready = []
                while self._release_seq in self._done:
                    ready += self._done.pop(self._release_seq)
                    self._release_seq += 1
            if chain and self.queue and not self._drain_pending:
                job = self._claim_ready(_now_us())
            if self._waiting_work() or self.stopping:   # the batcher has work; or close()
                self.cond.notify_all()                    # waits for the last execution
        for done, result in ready:
            if done.request.trace is not None:
                done.request.trace.answered()
            settle(done.future, result)
        return job

    def _waiting_work(self) -> bool:
        """Whether requests wait for an instance (then `_complete` wakes the batcher thread;
        else waking it costs a thread switch per request and finds nothing to do)."""
        return bool(self.queue) and not self._drain_pending

    def _fail(self, p: Pending, error: InferError) -> None:
        self.stats.record_failure(time.perf_counter_ns() - p.key.enqueued_ns)
        settle(p.key.future, error)

    def abort_all(self, message: str) -> None:
        """Answer every request not answered yet with InferError(503, `message`) (a server
        past its drain deadline): queued ones never run, and a running one's result is
        dropped when its execution ends."""
        for future in list(self.inflight):
            settle(future, InferError(message, 503))

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop accepting, let queued and running requests finish, then finalize instances,
        all within `timeout_s` seconds. Returns False when that time ran out: an execution or
        a `finalize` of the model's code was still running (it is logged and left behind)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout_s)
        self.pool.shutdown(wait=False)
        with self.cond:
            idle = self.cond.wait_for(lambda: self.executing == 0,
                                      max(0.0, deadline - time.monotonic()))
        if not idle:
            logger.error("model %s: an execution did not end within %.0f s; its instances are "
                         "not finalized", self.config.name, timeout_s)
            return False
        done = _bounded(lambda: [inst.close() for inst in self.instances],
                        deadline - time.monotonic())
        if not done:
            logger.error("model %s: finalize did not end within %.0f s", self.config.name,
                         timeout_s)
        if self.strategy is not None:
            self.strategy.close()
        return done
