"""BASELINE, not Continuum: transformers' static-batch `generate` behind an OpenAI route.

What `continuum bench compare` measures Continuum against. Requests are grouped into static
batches (up to `--batch-size`, waiting at most `--batch-wait-ms` for more), left-padded, and run
with one `model.generate` call that lasts until the batch's longest request is done — no request
joins or leaves a running batch. Tokens stream to each client as each step produces them
(a batched streamer); a request stops at its own `max_tokens` or EOS (unless `ignore_eos`) while
its batch goes on. Greedy when `temperature` is 0, else sampled.

Serves `POST /v1/completions` and `POST /v1/chat/completions` (streamed or not, with usage) and
`GET /v1/models`.

    python -m benchmarks.servebench.hf_baseline_server MODEL_DIR --port 8001 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from tokenizers.decoders import DecodeStream
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class _Job:
    def __init__(self, ids: list[int], max_tokens: int, ignore_eos: bool, temperature: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.ids, self.max_tokens, self.ignore_eos = ids, max_tokens, ignore_eos
        self.temperature, self.loop, self.out = temperature, loop, asyncio.Queue()
        self.count, self.done = 0, False

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _BatchStreamer(BaseStreamer):
    """Receives each step's `[batch]` new tokens from `generate` and routes them per job."""

    def __init__(self, jobs: list[_Job], eos: int | None) -> None:
        self.jobs, self.eos, self.first = jobs, eos, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:                      # the prompt itself
            self.first = False
            return
        for job, tok in zip(self.jobs, value.reshape(len(self.jobs), -1)[:, -1].tolist()):
            if job.done:
                continue
            if tok == self.eos and not job.ignore_eos:
                job.done = True
                job.push(("end", "stop"))
                continue
            job.count += 1
            job.push(("token", tok))
            if job.count >= job.max_tokens:
                job.done = True
                job.push(("end", "length"))

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                job.done = True
                job.push(("end", "length"))


class StaticBatcher:
    """One worker thread; each iteration takes up to `batch_size` queued jobs and runs them."""

    def __init__(self, model, tokenizer, batch_size: int, wait_s: float) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.wait_s = batch_size, wait_s
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + self.wait_s
            while len(batch) < self.batch_size:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                self._generate(batch)
            except Exception as e:          # the batch fails, the server goes on
                for job in batch:
                    job.push(("error", f"{type(e).__name__}: {e}"))

    def _generate(self, batch: list[_Job]) -> None:
        width = max(len(j.ids) for j in batch)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(j.ids)) + j.ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in batch])
        temperature = batch[0].temperature
        kwargs = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs["temperature"] = temperature
        eos = self.tokenizer.eos_token_id
        new = max(j.max_tokens for j in batch)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                pad_token_id=pad, streamer=_BatchStreamer(batch, eos), **kwargs)


def build_app(model_dir: str, dtype: str, batch_size: int, wait_ms: float,
              name: str) -> FastAPI:
    """The baseline ASGI app: loads the model (`dtype` "float32" or "bfloat16") and starts its batcher; batches wait at most `wait_ms` milliseconds to fill."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    batcher = StaticBatcher(model, tokenizer, batch_size, wait_ms / 1000)
    backend = tokenizer._tokenizer
    app = FastAPI(title="transformers static-batching BASELINE")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "root": model_dir,
                                            "owned_by": "hf-baseline"}]}

    @app.get("/health")
    async def health():
        return {}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if chat:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        else:
            ids = tokenizer.encode(body["prompt"]) if isinstance(body["prompt"], str) \
                else list(body["prompt"])
        job = _Job(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")),
                   float(body.get("temperature", 1.0)), asyncio.get_running_loop())
        batcher.jobs.put(job)
        rid, created = f"baseline-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        stream = DecodeStream(ids=ids[-6:], skip_special_tokens=True)

        async def deltas():
            while True:
                kind, value = await job.out.get()
                if kind == "token":
                    yield stream.step(backend, value) or "", None
                elif kind == "end":
                    yield "", value
                    return
                else:
                    raise RuntimeError(value)

        def choice(text, finish):
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": job.count,  # noqa: E731
                         "total_tokens": len(ids) + job.count}
        if body.get("stream"):
            async def events():
                async for text, finish in deltas():
                    yield json.dumps({"id": rid, "object": obj, "created": created,
                                      "model": name, "choices": [choice(text, finish)]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield json.dumps({"id": rid, "object": obj, "created": created,
                                      "model": name, "choices": [], "usage": usage()})
                yield "[DONE]"
            return EventSourceResponse(events())
        text, finish = "", None
        async for piece, f in deltas():
            text, finish = text + piece, f or finish
        msg = ({"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish} if chat else
               {"index": 0, "text": text, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": obj.removesuffix(".chunk"), "created": created,
                             "model": name, "choices": [msg], "usage": usage()})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batch-wait-ms", type=float, default=50.0)
    ap.add_argument("--served-model-name", default="hf-baseline")
    args = ap.parse_args()
    import uvicorn
    uvicorn.run(build_app(args.model_dir, args.dtype, args.batch_size, args.batch_wait_ms,
                          args.served_model_name),
                host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
