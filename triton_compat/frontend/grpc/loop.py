"""grpcio's core server driven by one completion-queue thread: Triton's gRPC service without a
thread hand-off per call.

Why not `grpc.server`: its Python layer takes each unary call through three hand-offs (poll
thread → pool worker → poll thread for the message → worker). Measured on the 2-core host with
a servicer that only returns a canned ModelInfer answer (benchmarks/grpc_floor.py): ~11 context
switches and 270–340 µs of server CPU per call, which put it below tritonserver before any work
of ours. The same canned servicer on this loop took 88–190 µs per call and 2–3× the rate.

Owns: `Server` (listen, start, stop with a grace period) and the per-call state `_Rpc`.
Data flow: one thread polls the completion queue (while calls follow each other closely, without
blocking for a moment first: `Server._next_event`). A new call is answered from the method
table that grpcio's generated `add_GRPCInferenceServiceServicer_to_server` fills in (names,
(de)serializers, streaming kinds):
- a method in `fast` (ModelInfer) is received and started on the loop thread, its message
  still serialized (the handler decodes it, or answers `PARSE_ERROR`):
  `fast[name](data, metadata, reply)` must not block; `reply` (a message, or its bytes
  already serialized) may be called from any thread (the one that finished the inference) and
  starts the final batch there;
- other unary methods run on a worker pool as grpcio runs them, `handler(request, context)`,
  since they may block (repository load, region mapping);
- a streaming method (ModelStreamInfer) gets a worker that iterates its response generator
  over a blocking request iterator, one message on the wire at a time, as grpcio does.
A handler's `context` offers `invocation_metadata()`, `abort(code, details)` and
`is_active()`, the part of `grpc.ServicerContext` the service uses.

Built on grpcio's Cython core (`grpc._cython.cygrpc`: Server, CompletionQueue, the batch
operations), the layer `grpc.server` and `grpc.aio` are themselves written over; HTTP/2,
message framing, flow control, metadata and status encoding stay in grpcio's C-core.
Reference: grpc/_server.py (the same calls, the same status texts), grpc/include/grpc/grpc.h
(batch operations, shutdown_and_notify).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc._cython import cygrpc

from engine.halt_poll import IDLE_POLLS, WINDOW_S, halt_poll

logger = logging.getLogger("continuum.triton.grpc")

OK = grpc.StatusCode.OK
_REQUEST, _SHUTDOWN, _DONE = object(), object(), object()
OUTSTANDING_REQUESTS = 16      # calls C-core may accept before the loop asks for more
PASS_EVENTS = 64               # events handled at most before `call_soon` callbacks run
# Poll without blocking for this long (s) after an event while calls arrive closely: see
# `Server._next_event`. Measured on a 2-core AMD EPYC VM, perf_analyzer gRPC c1 on `simple`:
# +7 % calls a second; at most SPIN_S of CPU is spent each time the traffic pauses.
SPIN_S = 200e-6
QUEUE_TIMEOUT = cygrpc.CompletionType.queue_timeout
PARSE_ERROR = "Unable to parse request"   # gRPC C++'s text, as tritonserver answers it


class _Abort(Exception):
    """`context.abort(code, details)`: end the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Rpc:
    """One call: its cygrpc Call, the client's metadata, and (streams) the mailboxes the loop
    fills: received messages (`inbox`, None = no more) and send completions (`sent`)."""

    __slots__ = ("call", "metadata", "cancelled", "inbox", "sent", "metadata_sent", "counted")

    def __init__(self, call, metadata) -> None:
        self.call, self.metadata = call, metadata
        self.cancelled, self.metadata_sent = False, False
        self.counted = False                # in `Server.active` until answered
        self.inbox: queue.SimpleQueue | None = None
        self.sent: queue.SimpleQueue | None = None

    def finish(self, message: bytes | None, code: grpc.StatusCode = OK, details: str = "",
               close: bool = True) -> None:
        """Start the call's last batch: initial metadata (if not sent yet), the response
        `message` (None: none) and the status. `close`: also learn when the call is over
        (unary calls; a stream started that at its beginning). Any thread."""
        ops = []
        if not self.metadata_sent:
            ops.append(cygrpc.SendInitialMetadataOperation((), 0))
            self.metadata_sent = True
        if message is not None:
            ops.append(cygrpc.SendMessageOperation(message, 0))
        ops.append(cygrpc.SendStatusFromServerOperation((), code.value[0], details.encode(), 0))
        if close:
            ops.append(cygrpc.ReceiveCloseOnServerOperation(0))
        self.call.start_server_batch(ops, _DONE)

    def send(self, message: bytes) -> bool:
        """A stream's next message; waits until C-core has taken it (one send in flight per
        call). False when the call is over (cancelled or gone)."""
        ops = [cygrpc.SendMessageOperation(message, 0)]
        if not self.metadata_sent:
            ops.insert(0, cygrpc.SendInitialMetadataOperation((), 0))
            self.metadata_sent = True
        self.call.start_server_batch(ops, (_on_sent, self))
        return self.sent.get()

    def receive(self):
        """A stream's next request message (bytes), or None when the client has half-closed
        or gone away. Blocks."""
        self.call.start_server_batch((cygrpc.ReceiveMessageOperation(0),), (_on_stream_in, self))
        return self.inbox.get()


def _on_sent(rpc: _Rpc, event) -> None:
    rpc.sent.put(event.success)


def _on_stream_in(rpc: _Rpc, event) -> None:
    rpc.inbox.put(event.batch_operations[0].message() if event.success else None)


def _on_closed(rpc: _Rpc, event) -> None:
    rpc.cancelled = event.batch_operations[0].cancelled()


class _Context:
    """What a handler may ask of its call (the used part of `grpc.ServicerContext`)."""

    def __init__(self, rpc: _Rpc) -> None:
        self._rpc = rpc

    def invocation_metadata(self):
        """The client's metadata: a tuple of (key, value)."""
        return self._rpc.metadata

    def abort(self, code: grpc.StatusCode, details: str):
        """End the call with `code` and `details`; raises, as grpcio's does."""
        raise _Abort(code, details)

    def is_active(self) -> bool:
        """False once the client has cancelled or gone away."""
        return not self._rpc.cancelled


class _Requests:
    """A stream's request iterator: each `next()` receives and deserializes one message."""

    def __init__(self, rpc: _Rpc, deserialize) -> None:
        self.rpc, self.deserialize = rpc, deserialize

    def __iter__(self):
        return self

    def __next__(self):
        data = self.rpc.receive()
        if data is None:
            raise StopIteration
        return self.deserialize(data)


class _Collector:
    """Stands in for a grpc.Server to take the generated code's method table."""

    def __init__(self) -> None:
        self.methods: dict[bytes, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Ignored: the same handlers come through add_registered_method_handlers."""

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        """Keep `handlers` under their full method paths, b"/service/Method"."""
        for name, handler in handlers.items():
            self.methods[f"/{service}/{name}".encode()] = handler


class Server:
    """Serve `register(servicer, collector)`'s methods (grpcio generated code's
    `add_..._to_server`) on one completion-queue thread. `fast`: {method name: callable
    (data, metadata, reply)} answered without a worker, `data` the request's serialized
    message; `reply(message, code=OK, details="")` ends the call (`message`: the response, its
    serialized bytes, or None). `options`: grpcio channel arguments ((name, value) pairs);
    `workers`: threads for the other methods. Raises RuntimeError from `add_insecure_port`
    when the address cannot be bound."""

    def __init__(self, servicer, register, fast: dict, options, workers: int) -> None:
        collector = _Collector()
        register(servicer, collector)
        self.methods = collector.methods
        self.fast = {m: fast[name] for m in self.methods
                     if (name := m.rsplit(b"/", 1)[1].decode()) in fast}
        self.cq = cygrpc.CompletionQueue()
        self.server = cygrpc.Server(tuple(options), False)
        self.server.register_completion_queue(self.cq)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="grpc")
        self.lock = threading.Lock()
        self.stopping = False
        self.stopped = threading.Event()
        self.active = 0                     # fast-method calls accepted and not yet answered
        self._soon: list = []               # `call_soon` callbacks for the end of this pass
        self._spin = False                  # calls arrive closely: poll before blocking
        self._halt = halt_poll()            # keeps the other CPUs awake meanwhile, or None

    def add_insecure_port(self, address: str) -> int:
        """Listen on `address` ("host:port"); the bound port, 0 when it cannot be bound."""
        return self.server.add_http2_port(address.encode())

    def add_secure_port(self, address: str, credentials) -> int:
        """Listen on `address` with TLS (`grpc.ServerCredentials`, as grpc/_server.py's
        `_add_secure_port` passes them to C-core); the bound port, 0 when it cannot be bound."""
        return self.server.add_http2_port(address.encode(), credentials._credentials)

    def start(self) -> None:
        """Start C-core and the loop thread (returns at once)."""
        self.server.start()
        for _ in range(OUTSTANDING_REQUESTS):
            self.server.request_call(self.cq, self.cq, _REQUEST)
        threading.Thread(target=self._serve, name="grpc-loop", daemon=True).start()

    def stop(self, grace: float | None) -> threading.Event:
        """Stop taking calls; calls still running get `grace` seconds (None: none) before
        they are cancelled. The event is set when every call is over."""
        with self.lock:
            if not self.stopping:
                self.stopping = True
                self.server.shutdown(self.cq, _SHUTDOWN)
        if grace is None:
            self.server.cancel_all_calls()
        else:
            def cancel_after_grace():
                if not self.stopped.wait(grace):
                    self.server.cancel_all_calls()
            threading.Thread(target=cancel_after_grace, daemon=True).start()
        return self.stopped

    def call_soon(self, callback) -> None:
        """Run `callback()` on the loop thread once the events already in the completion queue
        are handled (at most PASS_EVENTS later): what `asyncio`'s `call_soon` is to the HTTP
        loop, so that a burst of calls to a cheap model queues first and runs as one batch.
        Loop thread only."""
        self._soon.append(callback)

    def busy(self) -> bool:
        """True while another fast-method call is in progress besides the caller's."""
        return self.active > 1

    def _run_soon(self) -> None:
        callbacks, self._soon = self._soon, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("gRPC loop callback failed")

    # -- the loop -----------------------------------------------------------------------------
    def _next_event(self):
        """The next completion-queue event; a queue_timeout one when `call_soon` callbacks
        wait and nothing has arrived. While calls follow each other closely (the last wait
        for an event was shorter than SPIN_S) the queue is polled without blocking for up to
        SPIN_S first: a thread that blocks is woken by the kernel when the next request lands,
        and on a virtual machine that wake-up is a large part of a small call's latency; the
        process's `HaltPoll` (engine/halt_poll.py) keeps the other CPUs awake meanwhile, where a
        client or a worker may be waiting, and for WINDOW_S after a blocking wait ends (the
        call that woke the loop is answered within it, to a client whose CPU halted while the
        loop waited). Measured on a 2-CPU AMD EPYC Zen 3 guest, perf_analyzer gRPC c1 on
        `simple`, six alternating rounds each, one run: with the window after a block, p99
        517-633 µs against 1,156-1,185 µs without and 2,581-3,056 against 2,413-2,717 infer/s
        (every pair faster); c4 and c16 within the rounds' noise."""
        if self._soon:
            return self.cq.poll(0)
        if self._spin:
            until, polls = time.perf_counter() + SPIN_S, 0
            while True:
                event = self.cq.poll(0)
                if event.completion_type != QUEUE_TIMEOUT:
                    if self._halt is not None and polls >= IDLE_POLLS:   # waited for
                        self._halt.keep_warm(WINDOW_S)
                    return event
                polls += 1
                if time.perf_counter() >= until:
                    break
            self._spin = False           # a pause in the traffic: block until it resumes
        waited = time.perf_counter()
        event = self.cq.poll(None)
        self._spin = time.perf_counter() - waited < SPIN_S
        if self._halt is not None:       # woken from idle: its answer's client may be halted
            self._halt.keep_warm(WINDOW_S)
        return event

    def _serve(self) -> None:
        handled = 0
        while True:
            if self._soon and handled >= PASS_EVENTS:
                self._run_soon()
                handled = 0
            event = self._next_event()
            if event.completion_type == QUEUE_TIMEOUT:
                self._run_soon()              # nothing more has arrived: end of the pass
                handled = 0
                continue
            handled += 1
            tag = event.tag
            try:
                if tag is _REQUEST:
                    self._on_call(event)
                elif tag is _SHUTDOWN:
                    self.pool.shutdown(wait=False)
                    self.stopped.set()
                elif tag is not _DONE and tag is not None:
                    tag[0](tag[1], event)
            except Exception:               # a bug here must not stop every other call
                logger.exception("gRPC completion-queue event failed")
            event = tag = None

    def _on_call(self, event) -> None:
        if not event.success:               # the server shut down before a call came
            return
        if not self.stopping:               # a call accepted before the shutdown is answered
            self.server.request_call(self.cq, self.cq, _REQUEST)
        rpc = _Rpc(event.call, event.invocation_metadata)
        method = event.call_details.method
        handler = self.methods.get(method)
        if handler is None or handler.request_streaming != handler.response_streaming:
            # unknown; or half-streaming, which Triton's service has none of. The texts here
            # and below are grpcio's (what grpc.server answered before); tritonserver's C++
            # gRPC answers the same codes with its own texts.
            rpc.finish(None, grpc.StatusCode.UNIMPLEMENTED, "")     # as tritonserver
        elif handler.request_streaming:
            rpc.inbox, rpc.sent = queue.SimpleQueue(), queue.SimpleQueue()
            rpc.call.start_server_batch((cygrpc.ReceiveCloseOnServerOperation(0),),
                                        (_on_closed, rpc))
            self.pool.submit(self._stream, rpc, handler)
        else:
            if method in self.fast:         # in progress from now: its message may come later
                with self.lock:
                    self.active += 1
                rpc.counted = True
            rpc.call.start_server_batch((cygrpc.ReceiveMessageOperation(0),),
                                        (self._on_message, (rpc, method, handler)))

    def _uncount(self, rpc: _Rpc) -> None:
        """A fast-method call is answered: no longer in progress (once)."""
        if rpc.counted:
            rpc.counted = False
            with self.lock:
                self.active -= 1

    def _on_message(self, args, event) -> None:
        rpc, method, handler = args
        data = event.batch_operations[0].message() if event.success else None
        if data is None:
            self._uncount(rpc)
            rpc.finish(None, grpc.StatusCode.UNIMPLEMENTED,
                       f'"{method.decode()}" requires exactly one request message.')
            return
        fast = self.fast.get(method)
        if fast is None:
            try:
                request = handler.request_deserializer(data)
            except Exception:
                rpc.finish(None, grpc.StatusCode.INTERNAL, PARSE_ERROR)
                return
            self.pool.submit(self._unary, rpc, handler, request)
            return
        serialize = handler.response_serializer

        def reply(message, code: grpc.StatusCode = OK, details: str = "") -> None:
            self._uncount(rpc)
            if message is not None and type(message) is not bytes:
                message = serialize(message)
            rpc.finish(message, code, details)

        try:
            fast(data, rpc.metadata, reply)
        except Exception as e:
            logger.exception("gRPC %s failed", method.decode())
            reply(None, grpc.StatusCode.UNKNOWN, f"Exception calling application: {e}")

    # -- worker threads -----------------------------------------------------------------------
    @staticmethod
    def _unary(rpc: _Rpc, handler, request) -> None:
        try:
            response = handler.unary_unary(request, _Context(rpc))
            rpc.finish(handler.response_serializer(response))
        except _Abort as a:
            rpc.finish(None, a.code, a.details)
        except Exception as e:
            logger.exception("gRPC handler failed")
            rpc.finish(None, grpc.StatusCode.UNKNOWN, f"Exception calling application: {e}")

    @staticmethod
    def _stream(rpc: _Rpc, handler) -> None:
        responses = handler.stream_stream(_Requests(rpc, handler.request_deserializer),
                                          _Context(rpc))
        try:
            for response in responses:
                if not rpc.send(handler.response_serializer(response)):
                    return                  # cancelled: C-core has ended the call
            rpc.finish(None, close=False)
        except _Abort as a:
            rpc.finish(None, a.code, a.details, close=False)
        except Exception as e:
            logger.exception("gRPC stream failed")
            rpc.finish(None, grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {e}",
                       close=False)
        finally:
            responses.close()           # the handler's clean-up runs now, not at collection
