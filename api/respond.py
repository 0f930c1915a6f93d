"""Serving one OpenAI-style request: submit its prompts to the engine, then stream the events
or wait for the whole body — what the chat, completions, responses and messages routes share.

Owns: `respond` (submission, the first output awaited so that an error before any output is an
HTTP error, the stream or the collected body, client-disconnect aborts) and `timed` (TTFT and
ITL as the client sees them; the request's OpenTelemetry span). In: a `ResponseContext`, prompt
token ids, `SamplingParams`. Out: a `StreamingResponse`, a `JSONResponse`, or an `APIError`.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.beam_search import beam_search
from api.errors import APIError, engine_error
from api.network import log_request
from api.openai_serving import ResponseContext, merge, sse_events
from engine.async_llm import ProcessAsyncLLM, RequestFailedError
from scheduler.request import SamplingParams

SSE_HEADERS = {"cache-control": "no-store", "x-accel-buffering": "no"}   # no proxy buffering


async def respond(request: Request, llm: ProcessAsyncLLM, ctx: ResponseContext, *, body,
                   prompts: list[list[int]], params: SamplingParams, param: str,
                   state, stream_body=None):
    """Submit `prompts` (token ids; one engine request each) with `params`, then stream SSE or
    wait for the whole body; errors before output → HTTP error naming `param`. `stream_body`
    (first output, the rest) → the stream's bytes: default `sse_events`' chunks."""
    if body.stream_options is not None:
        ctx.include_usage = body.stream_options.include_usage
        ctx.continuous_usage = body.stream_options.continuous_usage_stats
    log_request(state.config.network, ctx.request_id, prompts, params, state.tokenizer)
    tag = uuid.uuid4().hex[:8]              # engine ids stay unique when clients reuse an id
    beam = body.beam_params(params)
    generate = llm.generate if beam is None else (     # api/beam_search.py: n beams
        lambda rid, p, _, prio: beam_search(llm, beam, state.tokenizer,
                                            state.tokenizer.eos_token_id, rid, p, prio))
    span = None if state.tracer is None else (state.tracer, state.tracer.context(
        request.headers), params, body.model)
    streams = [timed(generate(f"{ctx.request_id}-{tag}-{i}", p, params, body.priority), state,
                      span)
               for i, p in enumerate(prompts)]
    merged = merge(streams)
    try:
        first = await merged.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as e:
        await merged.aclose()
        raise engine_error(e, param) from None
    if body.stream:
        # starlette's StreamingResponse, as vLLM streams (a task per stream watching for the
        # client's disconnect; per event one `send`); sse_events frames the events itself
        events = (sse_events(ctx, first, merged) if stream_body is None
                  else stream_body(first, merged))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect():
        if first is not None:
            ctx.absorb(*first)
        async for group, out in merged:
            ctx.absorb(group, out)

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
        task.result()
    except RequestFailedError as e:
        raise APIError(500, str(e), "internal_error") from None
    finally:
        await merged.aclose()
    return JSONResponse(ctx.final_body())


async def timed(stream, state, span=None):
    """Pass outputs through, observing TTFT and ITL as the client sees them; with `span`
    ((RequestTracer, trace context, params, model) under --otlp-traces-endpoint) the request's
    span goes out with its last output."""
    start = last = time.perf_counter()
    first = True
    try:
        async for out in stream:
            now = time.perf_counter()
            if first:
                state.metrics.ttft.observe(now - start)
                first = False
            else:
                state.metrics.itl.observe(now - last)
            last = now
            if span is not None and out.finished:
                tracer, context, params, model = span
                tracer.record(out, params, model, context)
            yield out
    finally:
        await stream.aclose()       # closing us must abort the engine request now, not at GC
