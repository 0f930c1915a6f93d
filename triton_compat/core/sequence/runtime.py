"""A model version under the sequence batcher: validation, slots, control inputs, implicit state.

Data flow: `SequenceRuntime.submit` reads the request's sequence id and flags, validates the
request (Triton's texts) and queues it in `scheduler.sequence_batcher.SequenceBatcher` under the
lock; the batcher thread reaps idle sequences and expired backlogs, and whenever an instance is
idle asks the batcher for that instance's batch. The instance's worker adds the control inputs
(START / END / READY / CORRID) and the slot's implicit state to every request, fills padding
slots (`direct`) with zero inputs and READY = false, runs the batch, keeps each slot's new state
from the model's state outputs, and resolves the futures with the outputs the client asked for.
The rest (instances, statistics, ordered release) is `ModelRuntime`'s.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from scheduler.sequence_batcher import SeqItem, SequenceBatcher, SequenceConfig, SequenceError
from triton_compat.core.backends import BackendRequest
from triton_compat.errors import InferError
from scheduler.futures import settle
from triton_compat.core.runtime import RESCHEDULE_REFUSED, Job, ModelRuntime, _now_us
from triton_compat.core.sequence.spec import SEQUENCE_END, SEQUENCE_START, SequenceSpec, \
    sequence_params, sequence_tensors
from triton_compat.core.validate import check_result

EXPIRED = "timeout of the corresponding sequence has been expired"   # Triton's reaper
DELAY_POLL_US = 10_000        # how often a held batcher (`_test_delay`) looks again, as Triton


def sequence_config(config) -> SequenceConfig:
    """The batcher's view of `sequence_batching` (direct when neither strategy is set)."""
    sb = config.sequence_batching
    instances = sum(g.count for g in config.instance_group)    # load_config made them >= 1
    idle = sb.max_sequence_idle_microseconds or 1_000_000
    if sb.WhichOneof("strategy_choice") == "oldest":
        o = sb.oldest
        return SequenceConfig("oldest", instances, max(1, o.max_candidate_sequences),
                              config.max_batch_size, o.max_queue_delay_microseconds,
                              preferred_batch_sizes=tuple(sorted(o.preferred_batch_size)),
                              max_sequence_idle_us=idle, model=config.name)
    d = sb.direct
    return SequenceConfig("direct", instances, max(1, config.max_batch_size),
                          config.max_batch_size, d.max_queue_delay_microseconds,
                          d.minimum_slot_utilization, max_sequence_idle_us=idle,
                          model=config.name)


class SequenceRuntime(ModelRuntime):
    """A loaded model with `sequence_batching`. Raises ConfigError (bad controls or state)
    or InferError(500) (an instance fails to load) from the constructor."""

    def __init__(self, config, model_dir: Path, version: int) -> None:
        self.spec = SequenceSpec(config, model_dir)
        self.seq = SequenceBatcher(sequence_config(config))
        self.states: dict[tuple[int, int], dict] = {}     # (instance, slot) -> state inputs
        self.extra_outputs = sequence_tensors(config)[1]
        self.iterative = config.sequence_batching.iterative_sequence
        self._ids = itertools.count(1)    # ids for iterative requests sent without one
        self._delay = _test_delay()
        super().__init__(config, model_dir, version)
        self.preserve = config.sequence_batching.oldest.preserve_ordering

    @property
    def runs_alone(self) -> bool:
        """Never: the sequence batcher batches the sequences' requests."""
        return False

    @property
    def pending_count(self) -> int:
        """Requests queued (in slots or the backlog) or executing."""
        return len(self.seq) + self.executing

    def submit(self, request: BackendRequest, datatypes: dict[str, str] | None = None,
               priority: int = 0, timeout_us: int | None = None,
               inline: bool = False, defer=None) -> Future:
        """Validate and queue one request of a sequence; the future resolves to {output name:
        array}. `timeout_us` bounds its wait in the backlog; `priority` does not apply.
        `inline`: a caller that may block (a gRPC worker) runs the batch itself when its
        slot's instance is idle and the batch is ready at once; `defer` is accepted for the
        runtime interface (the sequence batcher forms its batches itself). Raises
        InferError(400) with Triton's texts for a bad input, correlation id or flags, 503
        while the model is being unloaded."""
        name = self.config.name
        corrid, flags = sequence_params(request.parameters)
        if isinstance(corrid, str) and len(corrid) > 128:     # tritonserver 2.51's order
            raise InferError("string correlation ID cannot be longer than 128 characters",
                             501)
        if self.iterative and corrid in (0, ""):     # Triton's IterativeSequencer
            corrid, flags = next(self._ids), SEQUENCE_START
        batch_size, shape_key = self._validate(request, datatypes)
        if batch_size > 1:
            raise InferError(f"inference request to model '{name}' must specify batch-size 1 "
                             "due to requirements of sequence batcher")
        if corrid in (0, ""):
            raise InferError(f"inference request to model '{name}' must specify a non-zero "
                             "or non-empty correlation ID")
        self.spec.check_corrid(corrid, request.id)
        request.correlation_id, request.flags = corrid, flags
        now, future = _now_us(), Future()
        self.inflight.add(future)                 # abort_all answers it at a shutdown
        future.add_done_callback(self.inflight.discard)
        item = SeqItem(Job(request, future, time.perf_counter_ns()), corrid,
                       bool(flags & SEQUENCE_START), bool(flags & SEQUENCE_END), now,
                       shape_key)
        with self.cond:
            if self.stopping:
                raise InferError(f"model '{name}' is being unloaded", 503)
            try:
                slot = self.seq.enqueue(item, now, timeout_us or 0)
            except SequenceError as e:
                raise InferError(str(e)) from None
            job = self._take(slot.instance, now)[0] if slot is not None else None
            if job is None or item.start:     # the batcher times the new idle limit
                self.cond.notify()
        if job is not None and inline:      # a thread that may block runs the batch itself
            self._run(*job)
        elif job is not None:               # no hand-off through the batcher thread
            self.pool.submit(self._run, *job)
        return future

    def _take(self, i: int, now_us: int) -> tuple[tuple | None, int | None]:
        """(the arguments of `_run` for instance `i`'s batch when the instance is idle and
        a batch is ready, else None; microseconds until the batcher should look again).
        Claims the instance. Caller holds the lock."""
        instance = self.instances[i]
        if instance not in self.idle:
            return None, None
        if self._delay is not None:         # Triton's test hook: hold until enough queued
            queued, backlog = self.seq.waiting()
            if queued < self._delay[0] or backlog < self._delay[1]:
                return None, DELAY_POLL_US
            self._delay = None
        entries, later = self.seq.next_batch(i, now_us)
        if not entries:
            return None, later
        self.idle.remove(instance)
        seq, self._batch_seq = self._batch_seq, self._batch_seq + 1
        self.executing += sum(1 for _, item in entries if item is not None)
        return (i, instance, entries, seq), None

    def _waiting_work(self) -> bool:
        return True                   # a freed instance may take a slot's next request

    def _loop(self) -> None:
        with self.cond:
            while not (self.stopping and not len(self.seq)):
                now = _now_us()
                rejected, _, wait = self.seq.reap(now)
                for item in rejected:
                    self._fail(item, InferError(EXPIRED, 503))
                for i in range(len(self.instances)):
                    job, later = self._take(i, now)
                    if job is not None:
                        self.pool.submit(self._run, *job)
                    elif later is not None:
                        wait = later if wait is None else min(wait, later)
                self.cond.wait(None if wait is None else max(wait, 1) / 1e6)

    def _requests(self, i: int, entries) -> list[BackendRequest]:
        """The backend requests of a batch: control inputs and state added, padding built
        from the first real request's shapes (zeros, READY false)."""
        spec, outputs = self.spec, self.extra_outputs
        first = next(item.key.request for _, item in entries if item is not None)
        requests = []
        for slot, item in entries:
            if item is None:
                inputs = {n: np.zeros_like(a) for n, a in first.inputs.items()}
                inputs.update(spec.control_inputs(0, False, 0))
                inputs.update((n, np.zeros_like(a)) for n, a in spec.initial_states().items())
                requests.append(BackendRequest(inputs, list(outputs), deliver=_ignore))
                continue
            r = item.key.request
            key = (i, slot.index)
            if item.start or key not in self.states:
                self.states[key] = spec.initial_states()
            inputs = dict(r.inputs)
            inputs.update(spec.control_inputs(r.flags, True, r.correlation_id))
            inputs.update(self.states[key])
            requests.append(BackendRequest(inputs, r.outputs + outputs, r.id, r.parameters,
                                           r.deliver, r.correlation_id, r.flags,
                                           cancelled=r.cancelled))
        return requests

    def _run(self, i: int, instance, entries, seq: int) -> None:
        start, requests = time.perf_counter_ns(), []
        try:
            requests = self._requests(i, entries)
            results, times = instance.execute(requests)
        except Exception as e:       # a backend bug: fail this batch only
            results, times = [InferError(f"{type(e).__name__}: {e}", 500)] * len(entries), None
            requests = [BackendRequest({}, []) for _ in entries]
        done, ran, again = [], [], []
        for (slot, item), req, result in zip(entries, requests, results):
            if item is None:
                continue
            if req.reschedule and self.iterative and not isinstance(result, Exception):
                again.append(item)               # runs again in a later batch
                ran.append((item.key, result))   # an inference of its own, as in Triton
                continue
            if req.reschedule:
                result = InferError(RESCHEDULE_REFUSED)
            wanted = item.key.request.outputs
            if not self.decoupled:
                result = check_result(self.signature, wanted, result, 1)
            if isinstance(result, dict) and self.spec.states:
                self._keep_state(self.states[(i, slot.index)], result)
                result = {k: v for k, v in result.items() if k in wanted}
            done.append((item.key, result))
            ran.append((item.key, result))
        self.stats.record_execution([job.enqueued_ns for job, _ in ran], [1] * len(ran),
                                    [r for _, r in ran], start, time.perf_counter_ns(),
                                    times, padded_size=len(entries))
        if self.iterative:
            self._iterate(again, [job.request.correlation_id for job, _ in done])
        self._complete(instance, done, seq)

    def _keep_state(self, state: dict, result: dict) -> None:
        """A slot's implicit state after an execution: each state whose output the model
        returned takes it; the others stay as they were (a python-backend model that does not
        return a state output keeps that state at its initial value, as in Triton)."""
        for s in self.spec.states:
            if s.output_name in result:
                state[s.input_name] = result[s.output_name]

    def _iterate(self, again: list[SeqItem], finished: list) -> None:
        """Iterative sequences: queue the rescheduled requests again (neither START nor END
        now) and free the slots of the sequences whose request is done."""
        with self.cond:
            self.executing -= len(again)
            for item in again:
                item.start = item.end = False
                item.key.request.flags = 0
                try:
                    self.seq.enqueue(item, _now_us())
                except SequenceError as e:       # its sequence had ended meanwhile
                    settle(item.key.future, InferError(str(e)))
            for corrid in finished:
                self.seq.finish(corrid)


def _test_delay() -> tuple[int, int] | None:
    """Triton core's scheduler test hooks, read when a model loads (its qa suites set them):
    `TRITONSERVER_DELAY_SCHEDULER=N` holds every batch until N requests are queued in the
    slots, `TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M` until M more wait in the backlog; then
    scheduling goes on as usual. None when neither is set."""
    count = int(os.environ.get("TRITONSERVER_DELAY_SCHEDULER", "0") or 0)
    backlog = int(os.environ.get("TRITONSERVER_BACKLOG_DELAY_SCHEDULER", "0") or 0)
    return (count, backlog) if count > 0 or backlog > 0 else None


def _ignore(result, final: bool) -> None:
    """The response sender of a padding request: its responses go nowhere."""
