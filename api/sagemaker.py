"""SageMaker's hosting routes, as vLLM serves them: `GET` / `POST /ping` (the liveness answer of
`/health`) and `POST /invocations` (a JSON body with `messages` is a chat completion, any other
body a completion, whose errors it then gets). Both sit outside `/v1`, so `--api-key` does not
guard them (vLLM's rule).

In: the server's `/health`, chat and completions handlers and its size-limited body reader.
Out: the two routes on the app. The body is read once, to choose, then replayed to the handler.
"""

from __future__ import annotations

import json

from fastapi import Request


def install(app, health, chat, completions, read_body) -> None:
    """Add `/ping` and `/invocations` to `app`; `read_body(request)` returns the body's bytes
    (raising the server's 413 past its limit)."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.post("/invocations")
    async def invocations(request: Request):
        raw = await read_body(request)
        try:
            is_chat = "messages" in json.loads(raw)
        except (ValueError, TypeError, RecursionError):
            is_chat = False
        return await (chat if is_chat else completions)(replayed(request, raw))


def replayed(request: Request, body: bytes) -> Request:
    """`request` with its body, already read, to be read again; later `receive`s (a
    disconnect) still come from the client."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)
