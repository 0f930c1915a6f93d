"""api/http_protocol.py: the writes of one event-loop pass leave as one write, in order, and
nothing held is lost on close; the loop polls after a response only while requests follow
closely (`BusyPoll`); end to end, HTTP responses and SSE streams through the real
server are covered by the API tests, which all run over this protocol."""

from __future__ import annotations

import asyncio

from api.http_protocol import BusyPoll, WriteCoalescer
from engine.halt_poll import IDLE_POLLS, WINDOW_S


class Transport:
    """The calls a transport gets, in order."""

    def __init__(self) -> None:
        self.calls: list = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.calls.append(("close",))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort",))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def test_writes_of_one_pass_leave_as_one_write_in_order():
    async def main():
        t = Transport()
        w = WriteCoalescer(t, asyncio.get_running_loop())
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        w.write(b"")
        w.write(b"ok")
        assert t.calls == [] and w.get_write_buffer_size() == 40
        await asyncio.sleep(0)              # the pass ends
        assert t.calls == [("write", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")]
        w.write(b"data: 1\n\n")               # a later event goes out in its own pass
        await asyncio.sleep(0)
        assert t.calls[-1] == ("write", b"data: 1\n\n")
        assert w.get_write_buffer_size() == 0
        assert w.get_extra_info("peername") == ("127.0.0.1", 1)    # the rest is the transport's
    asyncio.run(main())


def test_close_sends_what_is_held_first_and_abort_drops_it():
    async def main():
        t = Transport()
        w = WriteCoalescer(t, asyncio.get_running_loop())
        w.write(b"last response")
        w.close()
        assert t.calls == [("write", b"last response"), ("close",)]
        await asyncio.sleep(0)              # the queued flush finds nothing to send
        assert len(t.calls) == 2
        t2 = Transport()
        w2 = WriteCoalescer(t2, asyncio.get_running_loop())
        w2.write(b"never sent")
        w2.abort()
        await asyncio.sleep(0)
        assert t2.calls == [("abort",)]
    asyncio.run(main())


def test_a_whole_response_goes_at_once_unless_writes_are_held():
    async def main():
        t = Transport()
        w = WriteCoalescer(t, asyncio.get_running_loop())
        w.write_now(b"response 1")             # nothing held: sent in this call
        assert t.calls == [("write", b"response 1")]
        w.write(b"head ")
        w.write_now(b"response 2")             # behind what is held, in order, one write
        assert len(t.calls) == 1
        await asyncio.sleep(0)
        assert t.calls[-1] == ("write", b"head response 2")
        t.closing = True
        w.write_now(b"never sent")             # a closing transport gets nothing
        assert len(t.calls) == 2
    asyncio.run(main())


class Halt:
    """A HaltPoll stand-in: the windows it was asked to keep the CPUs awake for."""

    def __init__(self) -> None:
        self.windows: list[float] = []

    def keep_warm(self, seconds: float) -> None:
        self.windows.append(seconds)


def test_the_loop_polls_after_a_response_while_requests_follow_closely():
    """BusyPoll: no polling until a request follows a response within the window; then the
    loop polls (a callback re-queued every pass) until the window after the last response
    ends; one late request keeps it polling, MISSES late ones in a row stop it. The CPUs are
    kept awake (HaltPoll) for a request the loop waited for, not one already queued."""
    async def main():
        loop, now, halt = asyncio.get_running_loop(), [0.0], Halt()
        poll = BusyPoll(loop, 1.0, clock=lambda: now[0], halt=halt)

        async def passes(n: int) -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        poll.same_run = BusyPoll.SAME_SOURCE_RUN   # one client, seen long enough
        poll.arrived()                      # the first request: nothing to go by
        poll.answered()
        assert not poll.spinning and halt.windows == []
        now[0] = 0.5
        poll.arrived()                      # within 1 s of the last answer: close
        assert halt.windows == [WINDOW_S]   # the CPUs kept awake for its answer
        now[0] = 0.6
        poll.answered()
        assert poll.spinning and poll.until == 1.6
        await passes(3)
        assert poll.spinning                # still polling: the window has not ended
        now[0] = 1.7
        await passes(2)
        assert not poll.spinning            # the window ended: the loop may block again
        now[0] = 5.0
        poll.arrived()                      # one late request (a miss)
        poll.answered()
        assert poll.spinning and len(halt.windows) == 2
        now[0] = 10.0
        await passes(2)
        poll.arrived()                      # a second miss in a row: stop polling
        poll.answered()
        await passes(2)
        assert not poll.spinning and len(halt.windows) == 2
        now[0] = 10.5
        poll.arrived()                      # close again: polling resumes
        poll.answered()
        assert poll.spinning and len(halt.windows) == 3
        now[0] = 10.6
        poll.arrived()                      # already waiting while the loop polls: a queue,
        assert len(halt.windows) == 3       # not an idle wait, so the CPUs are busy anyway
        poll.answered()
        await passes(IDLE_POLLS)
        poll.arrived()                      # waited for through IDLE_POLLS empty passes
        assert len(halt.windows) == 4
        now[0] = 20.0
        await passes(2)
    asyncio.run(main())


def test_clients_taking_turns_do_not_keep_the_cpus_awake():
    """BusyPoll: a request the loop waited for keeps the CPUs awake only when it came on the
    connection of the one before (a client turning each answer into its next request); where
    several connections take turns (perf_analyzer c4) the CPUs are not spun for."""
    async def main():
        loop, now, halt = asyncio.get_running_loop(), [0.0], Halt()
        poll = BusyPoll(loop, 1.0, clock=lambda: now[0], halt=halt)
        for i in range(8):                  # four clients in turn, each request close
            now[0] += 0.1
            poll.arrived(source=1 + i % 4)
            now[0] += 0.1
            poll.answered()
            for _ in range(IDLE_POLLS):
                await asyncio.sleep(0)
        assert halt.windows == []
        for _ in range(BusyPoll.SAME_SOURCE_RUN + 2):   # one client alone: kept awake
            now[0] += 0.1                                # once it has shown it is
            poll.arrived(source=7)
            now[0] += 0.1
            poll.answered()
            for _ in range(IDLE_POLLS):
                await asyncio.sleep(0)
        assert halt.windows == [WINDOW_S] * 2
        now[0] = 99.0
        for _ in range(2):
            await asyncio.sleep(0)
    asyncio.run(main())
