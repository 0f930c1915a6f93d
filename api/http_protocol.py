"""uvicorn's httptools HTTP/1.1 protocol with the writes of one event-loop pass joined.

Owns: `HttpToolsProtocol` (what `continuum serve` passes to uvicorn as `http=`) and the
transport wrapper `WriteCoalescer` behind it. uvicorn writes a response's head and its body
as two `transport.write` calls, and uvloop sends each at once: two `send` syscalls and two TCP
segments per response on a keep-alive connection (strace under perf_analyzer: 2.0 writes per
request), and each response goes out while the loop still has other requests of the same pass
to serve. Here a connection's writes are held until the callbacks already queued on the event
loop have run (one `call_soon`), then sent as one write: a response's head and body become one
send, and under load the responses of one pass leave together at its end. Measured with
perf_analyzer on the v2 `simple` model, side by side, three rounds: p99 latency lower in 8 of
10 pairs (HTTP binary at 16 connections: 4.4 ms against 7.2–7.7 ms), throughput within the
host's noise. An SSE stream's events of one pass also leave as one send.
After a claimed request's response, while requests follow each other closely, the event loop
polls its sockets without blocking for a moment (`BusyPoll`): on a virtual machine, waking a
thread blocked in epoll was most of the latency of a small request.
It also counts the requests in progress (`requests_in_progress`), which the v2 infer path
reads to batch a burst of requests to a cheap model (triton_compat/core/runtime.py), and
answers the requests a `route` claims by their head itself (`HttpToolsProtocol.answering`:
the v2 infer path, triton_compat/frontend/http_infer.py `InferRoute`): no ASGI scope, task,
middleware or `send` messages, the response written as one buffer; a pipelined request behind
it waits in uvicorn's queue as behind any other.
Flows in: uvicorn's protocol calls; flows out: the same bytes, in the same order, to the real
transport. `close()` / `write_eof()` send what is held first; `abort()` drops it, as a
transport's own buffer is dropped.
At a server's stop, a TLS connection that is closed (at once when idle, after its response
otherwise) is aborted if its client has not answered the close within TLS_CLOSE_GRACE_S: an SSL
transport's close waits up to 30 s for the client's close_notify, which an idle pooled client
never sends (it reads nothing), so one such client held every HTTPS stop for uvicorn's whole
graceful timeout (5 s, with an error line).
"""

from __future__ import annotations

import asyncio
import time
import weakref

from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol

from engine.halt_poll import IDLE_POLLS, WINDOW_S, HaltPoll, halt_poll
from engine.log_config import access_logged


class WriteCoalescer:
    """An `asyncio.Transport` stand-in that joins the writes made within one pass of `loop`
    into one `write` of `transport`; everything else goes to `transport` as is.
    `get_write_buffer_size()` counts held bytes too, so flow control sees them."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self.stopping = False          # set by the protocol's shutdown()
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Hold `data` until the callbacks queued on the loop have run, then write it with
        whatever joined it meanwhile."""
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def write_now(self, data: bytes) -> None:
        """`data` sent at once when nothing is held (it is a whole response already: nothing
        in this pass would join it), else after what is held, in order."""
        if self._held:
            self.write(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, chunks) -> None:
        """`write` of each chunk."""
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what is held as one write (nothing once the transport is closing)."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        """Send what is held, then close; at a server's stop (`stopping`), a TLS connection
        still open TLS_CLOSE_GRACE_S later is aborted (see the module docstring)."""
        self.flush()
        self._transport.close()
        if self.stopping and self._transport.get_extra_info("sslcontext") is not None:
            self._loop.call_later(TLS_CLOSE_GRACE_S, self._transport.abort)

    def write_eof(self) -> None:
        """Send what is held, then half-close."""
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        """Drop what is held and abort, as `Transport.abort` drops its buffer."""
        self._held = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """Bytes held here and in the transport's own buffer."""
        return sum(map(len, self._held)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class BusyPoll:
    """Keeps one event loop polling its sockets without blocking for up to `spin_s` seconds
    after a response, while requests follow each other closely; the loop blocks in epoll as
    before once they stop.

    Why: a thread blocked in epoll is woken by the kernel when the next request lands, and on
    a virtual machine whose CPU went idle meanwhile that wake-up is slow and erratic. Measured
    on a 2-CPU AMD EPYC VM with perf_analyzer HTTP c1 on `simple` (server-side timestamps):
    ~75 % of requests found the loop asleep, and those waited 1.1-1.2 ms from the last
    response at p90 where the client's turnaround is ~0.13 ms; with the loop polling, 0.10 /
    0.13 ms (p50 / p90) and 1,370-1,510 → 2,060-2,510 infer/s. The gRPC loop does the same
    (triton_compat/frontend/grpc/loop.py `SPIN_S`).

    How: a callback that re-queues itself with `call_soon` until the deadline: a loop with a
    ready callback polls with a zero timeout (uvloop and asyncio alike). `arrived` at each
    request's head notes whether it came within `spin_s` of the last response (a miss if not);
    `answered` at each response moves the deadline to `spin_s` from now unless the last
    `MISSES` requests all missed: one late request (a slow client turn, a wake-up that found
    the loop asleep) does not end the polling, a pause in the traffic costs at most
    MISSES x `spin_s` of CPU, and polling resumes once a request follows a response closely."""

    MISSES = 2
    # Requests in a row on one connection (after the first) before its client counts as alone:
    # four clients in turn put two of theirs in a row one time in four, and one millisecond of
    # spin per such request kept the CPUs spinning most of the time.
    SAME_SOURCE_RUN = 8

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float,
                 clock=time.perf_counter, halt: HaltPoll | None = None) -> None:
        self.loop, self.spin_s, self.clock, self.halt = loop, spin_s, clock, halt
        self.last_answer = float("-inf")    # when the last response was written (clock s)
        self.misses = self.MISSES           # late requests in a row
        self.until = 0.0                    # polling deadline (clock s)
        self.spinning = False
        self.polls = 0                      # loop passes polled since the last answer
        self.last_source = 0                # the connection of the last request (`arrived`)
        self.same_run = 0                   # requests in a row on that connection, less one

    def arrived(self, source: int = 0) -> None:
        """A request's head was parsed on connection `source` (any id of it). If the loop
        waited for it (it polled empty IDLE_POLLS times since the last answer, or blocked),
        requests follow closely and the last SAME_SOURCE_RUN came on this connection (one
        client turning each answer into its next request), the process's `HaltPoll` (if on)
        keeps the other CPUs awake for its answer, whose client may be waiting on one of them
        (engine/halt_poll.py). Not under concurrent load: where the next request is already
        waiting, spinning on the CPUs cost 15 % of perf_analyzer's c16 rate (the host sees the
        VM's CPUs always busy); where several clients take turns (c4) the loop still waits
        between requests, and the spin ran 16 % of the wall time for nothing (py-spy, Intel
        Emerald Rapids guest, session 35)."""
        if self.clock() - self.last_answer < self.spin_s:
            self.misses = 0
        else:
            self.misses += 1
        self.same_run = self.same_run + 1 if source == self.last_source else 0
        self.last_source = source
        if (self.halt is not None and self.same_run >= self.SAME_SOURCE_RUN
                and self.misses < self.MISSES
                and (self.polls >= IDLE_POLLS or not self.spinning)):
            self.halt.keep_warm(WINDOW_S)

    def answered(self) -> None:
        """A response was written: poll for the next request until `spin_s` from now while
        requests follow each other closely."""
        self.last_answer = now = self.clock()
        self.polls = 0
        if self.misses < self.MISSES:
            self.until = now + self.spin_s
            if not self.spinning:
                self.spinning = True
                self.loop.call_soon(self._spin)

    def _spin(self) -> None:
        self.polls += 1
        if self.clock() < self.until:
            self.loop.call_soon(self._spin)
        else:
            self.spinning = False


# Poll without blocking for this long (s) after a response while requests arrive closely:
# see `BusyPoll`. 0.2 ms covers the p99 of a c1 client's turnaround measured with it on.
SPIN_S = 200e-6
_busy_polls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # loop -> BusyPoll


def busy_poll(loop: asyncio.AbstractEventLoop) -> BusyPoll:
    """The `BusyPoll` of `loop` (one per event loop, shared by its connections)."""
    poll = _busy_polls.get(loop)
    if poll is None:
        poll = _busy_polls[loop] = BusyPoll(loop, SPIN_S, halt=halt_poll())
    return poll


_in_progress = [0]            # requests whose head has arrived and whose response has not ended
TLS_CLOSE_GRACE_S = 0.5       # at a stop: how long a TLS client gets to answer the close (s)


def requests_in_progress() -> int:
    """HTTP requests of this process begun and not yet answered, counted when their head is
    parsed, so a request that arrived in this event-loop pass counts before its handler runs.
    The v2 infer path reads it to tell a lone request (run a cheap model at once) from a burst
    (let the pass's requests queue and run as one batch)."""
    return _in_progress[0]


class _FastCycle:
    """What uvicorn's protocol sees as its current `RequestResponseCycle` while it answers a
    request itself (`HttpToolsProtocol.route`): not complete, so a pipelined request queues
    behind it as behind any other; `disconnected` and `keep_alive` as uvicorn sets them."""

    __slots__ = ("response_complete", "disconnected", "keep_alive", "message_event", "path",
                 "logged")

    def __init__(self, url: bytes) -> None:
        self.response_complete, self.disconnected, self.keep_alive = False, False, True
        self.path = url.decode("latin-1")    # for the access log
        self.logged = access_logged(url)     # whether it gets a line there
        self.message_event = self           # connection_lost calls message_event.set()

    def set(self) -> None:
        """Nothing waits on this cycle's body."""


class HttpToolsProtocol(_HttpToolsProtocol):
    """uvicorn's httptools protocol over a `WriteCoalescer` (see the module docstring),
    counting the requests in progress (`requests_in_progress`), and answering the requests
    its `route` claims itself, without ASGI (`answering`)."""

    _counted = False
    route = None             # claim(url, headers) -> claim | None; answers_now(claim) -> bool;
    #                          answer(claim, body) -> (status, body, headers) | coroutine
    _claim = None            # the claimed request whose body is arriving
    _body: list
    busy: BusyPoll           # this loop's, shared by its connections

    @classmethod
    def answering(cls, route) -> type:
        """This protocol with `route`: a request whose head `route.claim(url, headers)`
        claims (a plain keep-alive HTTP/1.1 request, no other in progress on the connection)
        is answered by `route.answer(claim, body)` — (status, body, headers)
        or a coroutine giving them — written here: no ASGI scope, task or middleware; at once
        when `route.answers_now(claim)`, else at the end of the event-loop pass. The access
        log (`--uvicorn-log-level info`, the default) gets uvicorn's line for it where
        `access_logged` says a v2 request gets one (`--log-verbose 1`)."""
        return type(cls.__name__, (cls,), {"route": route})

    def on_headers_complete(self) -> None:
        """Claimed by `route`: its body is collected here; else uvicorn's ASGI cycle, with
        an access line where `access_logged` says so (not for the v2 routes by default)."""
        route = self.route
        if (route is not None and not self.pipeline
                and (self.cycle is None or self.cycle.response_complete)
                and not self.expect_100_continue and self.parser.get_method() == b"POST"
                and self.parser.get_http_version() == "1.1"
                and self.parser.should_keep_alive() and not self.root_path):
            claim = route.claim(self.url, self.headers)
            if claim is not None:
                self._claim, self._body = claim, []
                self.cycle = _FastCycle(self.url)   # type: ignore
                return
        before = self.cycle
        super().on_headers_complete()
        if self.access_log and self.cycle is not before and not access_logged(self.url):
            self.cycle.access_log = False

    def on_body(self, body: bytes) -> None:
        if self._claim is not None:
            self._body.append(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        claim = self._claim
        if claim is None:
            super().on_message_complete()
            return
        self._claim, body = None, self._body
        body = body[0] if len(body) == 1 else b"".join(body)
        if self.route.answers_now(claim):
            self._answer(self.cycle, claim, body)
            return
        # answered once this event-loop pass has read what else arrived: the requests of a
        # burst are all counted in progress first (`requests_in_progress`), so a cheap model
        # runs them as one batch instead of each alone
        self.loop.call_soon(self._answer, self.cycle, claim, body)

    def _answer(self, cycle: _FastCycle, claim, body: bytes) -> None:
        if cycle.disconnected:               # the client left: nobody to answer
            return
        answer = self.route.answer(claim, body)
        if isinstance(answer, tuple):
            self._respond(cycle, *answer)
            return
        task = self.loop.create_task(self._respond_later(cycle, answer))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _respond_later(self, cycle: _FastCycle, answer) -> None:
        self._respond(cycle, *await answer)

    def _respond(self, cycle: _FastCycle, status: int, body: bytes, headers: list) -> None:
        """Write a claimed request's response, then what uvicorn does after any response;
        the loop polls for the next request a moment if they follow closely (`BusyPoll`)."""
        if cycle.disconnected:
            return
        head = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers,
                            (b"content-length", str(len(body)).encode()), *headers):
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", body)
        self.transport.write_now(b"".join(head))
        if self.access_log and cycle.logged:   # uvicorn's access line, as its cycle logs it
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', "%s:%d" % self.client
                                    if self.client else "", "POST", cycle.path, "1.1", status)
        cycle.response_complete = True
        if not cycle.keep_alive:             # the server is shutting down
            self.transport.close()
        self.on_response_complete()
        self.busy.answered()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.busy = busy_poll(self.loop)
        super().connection_made(WriteCoalescer(transport, self.loop))

    def shutdown(self) -> None:
        """uvicorn's (an idle connection closes now, a busy one after its response), with the
        transport told that the server stops (TLS connections: see the module docstring)."""
        self.transport.stopping = True
        super().shutdown()

    def on_message_begin(self) -> None:
        """A request starts: count it until its response ends (or its connection), and the
        keep-alive timer stops (a request answered within the same `data_received` as this
        one, `answers_now`, armed it: uvicorn stops it only when data arrives); the loop's
        `BusyPoll` learns whether it followed the last response closely."""
        self._unset_keepalive_if_required()
        super().on_message_begin()
        if not self._counted:
            self._counted = True
            _in_progress[0] += 1
        self.busy.arrived(id(self))

    def on_response_complete(self) -> None:
        """Its response has ended: no longer in progress."""
        self._uncount()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection went away, perhaps mid-request."""
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            _in_progress[0] -= 1
