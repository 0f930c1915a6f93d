"""`continuum run-batch -i IN -o OUT [serve flags]`: offline batch inference over a file in
OpenAI's batch format, as `vllm run-batch` runs it.

Owns: reading and checking the input lines, running them against a server of its own, and
writing one output line per input line, in input order.

Input (a local path or an http(s) URL, read with GET): JSON lines
`{"custom_id": str, "method": "POST", "url": str, "body": {...}}`; blank lines are skipped.
A line that is not such an object stops the run before the model loads, naming the line
(vLLM 0.32 fails the run with a traceback there). Served URLs: `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`, `/v1/responses` (OpenAI's batch API's; vLLM 0.32 takes
chat completions and embeddings of these, plus its score / rerank / audio routes, which
Continuum does not serve).

Running: the serve flags start `continuum serve` as a child process on a free loopback port
(its access log off; TLS flags refused: nothing is exposed), so each line is answered exactly
as the server answers it; lines go out concurrently, at most `--max-num-seqs` (256 by
default) at a time, a 503 `queue_full` retried after its `Retry-After`. The child is stopped
(SIGINT, then SIGKILL after 30 s) when all lines are answered.

Output (a local path, or an http(s) URL written with PUT): per line
`{"id": "batch_req_<hex>", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}` — `body` the JSON answer and `error` null on a 2xx; else `body` null and `error`
the server's error object (`{"error": {...}}`). A line with another URL, another method, or
`stream: true` is not sent: status 400 and `error` a sentence, as vLLM writes those. The
request id goes out as `X-Request-Id`, so an answer's id is `chatcmpl-<request_id>` /
`cmpl-<request_id>`. Exit status 0 once the output is written, 1 when the server cannot start,
2 for bad flags or input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class BatchInputError(ValueError):
    """A line of the input file that is not a batch request (the message names the line)."""


@dataclass
class BatchLine:
    """One request of the batch: its `custom_id`, `method`, `url` and JSON `body`."""
    custom_id: str
    method: str
    url: str
    body: dict


def add_run_batch_flags(p: argparse.ArgumentParser) -> None:
    """`-i` / `-o` (vLLM's names) on a parser that already has the serve flags."""
    p.add_argument("-i", "--input-file", required=True, metavar="PATH_OR_URL",
                   help="batch requests, one JSON object a line (OpenAI's batch format)")
    p.add_argument("-o", "--output-file", required=True, metavar="PATH_OR_URL",
                   help="where the answers go, one JSON object a line, in input order")


def parse_lines(text: str, where: str) -> list[BatchLine]:
    """The batch requests of an input file's text. Raises BatchInputError naming
    `where:LINE` for a line that is not `{"custom_id", "method", "url", "body"}`."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise BatchInputError(f"{where}:{n}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise BatchInputError(f"{where}:{n}: a line must be a JSON object")
        for key, kind in (("custom_id", str), ("method", str), ("url", str), ("body", dict)):
            if not isinstance(obj.get(key), kind):
                raise BatchInputError(f"{where}:{n}: '{key}' must be a "
                                      f"{'JSON object' if kind is dict else 'string'}")
        out.append(BatchLine(obj["custom_id"], obj["method"], obj["url"], obj["body"]))
    return out


def _refusal(line: BatchLine) -> str | None:
    """Why `line` is not sent (vLLM's sentences), or None."""
    if line.url not in URLS:
        return f"URL {line.url} was used. Supported endpoints: {', '.join(URLS)}."
    if line.method.upper() != "POST":
        return f"Method {line.method} was used. Only POST is supported."
    if line.body.get("stream"):
        return "Request must not be sent in stream mode"
    return None


def _output(line: BatchLine, status: int, request_id: str, body, error) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": error}


async def run_line(client, line: BatchLine, gate: asyncio.Semaphore,
                   headers: dict) -> dict:
    """The output object of one line (see the module docstring); `client` an
    `httpx.AsyncClient` on the server."""
    request_id = uuid.uuid4().hex
    if (why := _refusal(line)) is not None:
        return _output(line, 400, request_id, None, why)
    async with gate:
        while True:
            r = await client.post(line.url, json=line.body, timeout=None,
                                  headers={**headers, "X-Request-Id": request_id})
            if r.status_code != 503 or "Retry-After" not in r.headers:
                break
            await asyncio.sleep(min(float(r.headers["Retry-After"]), 5.0))
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text, "type": "internal_error"}}
    ok = 200 <= r.status_code < 300
    return _output(line, r.status_code, request_id, body if ok else None, None if ok else body)


async def run_lines(base: str, lines: list[BatchLine], concurrency: int,
                    api_key: str | None) -> list[dict]:
    """Every line's output, in input order, from the server at `base`."""
    import httpx
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        with tqdm(total=len(lines), unit="req", desc="Running batch", mininterval=5,
                  file=sys.stderr) as bar:
            async def one(line):
                out = await run_line(client, line, gate, headers)
                bar.update()
                return out
            return await asyncio.gather(*(one(line) for line in lines))


def read_input(path: str) -> str:
    """The input file's text: a local path, or an http(s) URL (GET). Raises OSError."""
    import httpx
    if path.startswith(("http://", "https://")):
        try:
            r = httpx.get(path, timeout=60, follow_redirects=True)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise OSError(f"cannot read {path}: {e}") from None
        return r.text
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_output(path: str, outputs: list[dict]) -> None:
    """Write the outputs as JSON lines: a local path, or an http(s) URL (PUT).
    Raises OSError."""
    import httpx
    text = "".join(json.dumps(o, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for o in outputs)
    if path.startswith(("http://", "https://")):
        try:
            httpx.put(path, content=text.encode(), timeout=600).raise_for_status()
        except httpx.HTTPError as e:
            raise OSError(f"cannot write {path}: {e}") from None
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_child(serve_argv: list[str], timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """`continuum serve SERVE_ARGV` on a free loopback port, ready. Raises RuntimeError when
    it exits or is not ready within `timeout` seconds."""
    import httpx
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "api", "serve", *serve_argv, "--host",
                             "127.0.0.1", "--port", str(port), "--grpc-port", "0",
                             "--disable-uvicorn-access-log"])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(base + "/health/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_child(proc)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s")


def stop_child(proc: subprocess.Popen) -> None:
    """Stop the server as Ctrl-C does; kill it if it has not exited in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_argv(argv: list[str]) -> list[str]:
    """`argv` less the run-batch flags (`-i`, `-o` and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-i", "-o", "--input-file", "--output-file"):
            skip = True
        elif not a.startswith(("--input-file=", "--output-file=")):
            out.append(a)
    return out


def main(args: argparse.Namespace, argv: list[str]) -> None:
    """`continuum run-batch`: exits 0 once the output is written, 1 if the server cannot
    start, 2 for bad flags or input (one line on stderr)."""
    try:
        if args.ssl_keyfile or args.ssl_certfile:
            raise ValueError("run-batch exposes no server: --ssl-* flags do not apply")
        lines = parse_lines(read_input(args.input_file), args.input_file)
    except (ValueError, OSError) as e:
        print(f"continuum: error: {e}", file=sys.stderr)
        sys.exit(2)
    if not lines:
        write_output(args.output_file, [])
        return
    try:
        proc, base = start_child(serve_argv(argv))
    except RuntimeError as e:
        print(f"continuum: error: {e}", file=sys.stderr)
        sys.exit(1)
    try:
        outputs = asyncio.run(run_lines(base, lines, args.max_num_seqs or 256,
                                        args.api_key or os.environ.get("CONTINUUM_API_KEY")))
    finally:
        stop_child(proc)
    write_output(args.output_file, outputs)
    failed = sum(o["error"] is not None for o in outputs)
    print(f"continuum run-batch: {len(outputs)} requests, {failed} failed; answers in "
          f"{args.output_file}", file=sys.stderr)
