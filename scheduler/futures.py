"""Settling a request's `concurrent.futures.Future` from whichever thread finishes it — the one
rule the engine front end (an add's acknowledgement) and the Triton runtimes (a request's
outputs) share.
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
