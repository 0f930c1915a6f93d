"""api/http_protocol.py: the writes of one event-loop pass leave as one write, in order, and
nothing held is lost on close; end to end, HTTP responses and SSE streams through the real
server are covered by the API tests, which all run over this protocol."""

from __future__ import annotations

import asyncio

from api.http_protocol import WriteCoalescer


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
