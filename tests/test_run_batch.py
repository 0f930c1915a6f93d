"""`continuum run-batch` (api/run_batch.py) as a user runs it: a file in OpenAI's batch format
in, one answer a line out in input order, each the server's own answer to that body (checked
against the session server), refused lines written as errors, a bad input file refused before
the model loads, and input / output over HTTP."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import httpx
import pytest

from tests.conftest import KEY, MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 8, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
SERVE = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "4"]


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run_batch(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api", "run-batch", *args, *SERVE],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.extended          # a server of its own
def test_a_batch_file_is_answered_line_by_line(tmp_path, server):
    lines = [line("chat", "/v1/chat/completions", CHAT),
             line("completion", "/v1/completions", COMPLETION), "",
             *(line(f"many-{i}", "/v1/completions", {**COMPLETION, "max_tokens": 2 + i})
               for i in range(6)),
             line("unknown-model", "/v1/chat/completions", {**CHAT, "model": "nope"}),
             line("bad-value", "/v1/completions", {**COMPLETION, "temperature": -1}),
             line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
             line("score", "/v1/score", {"text_1": "a", "text_2": "b"}),
             line("get", "/v1/completions", COMPLETION, method="GET")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    done = run_batch(["-i", str(src), "-o", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    outputs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [json.loads(x)["custom_id"] for x in lines if x]
    by_id = {o["custom_id"]: o for o in outputs}
    headers = {"Authorization": f"Bearer {KEY}"}
    for custom_id, path, body in (("chat", "/v1/chat/completions", CHAT),
                                  ("completion", "/v1/completions", COMPLETION)):
        o = by_id[custom_id]
        expected = httpx.post(server + path, json=body, headers=headers, timeout=60).json()
        assert o["error"] is None and o["response"]["status_code"] == 200
        got = o["response"]["body"]
        assert got["id"].endswith(o["response"]["request_id"])     # sent as X-Request-Id
        assert got["choices"] == expected["choices"] and got["usage"] == expected["usage"]
    assert [by_id[f"many-{i}"]["response"]["body"]["usage"]["completion_tokens"]
            for i in range(6)] == [2 + i for i in range(6)]
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["error"]["error"]["type"] == "NotFoundError"
    assert by_id["bad-value"]["response"]["status_code"] == 400
    assert by_id["bad-value"]["error"]["error"]["param"] == "temperature"
    assert by_id["stream"]["error"] == "Request must not be sent in stream mode"
    assert "Supported endpoints" in by_id["score"]["error"]
    assert "Only POST" in by_id["get"]["error"]
    for key in ("unknown-model", "bad-value", "stream", "score", "get"):
        assert by_id[key]["response"]["body"] is None


@pytest.mark.parametrize("text,message", [
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions"', "in.jsonl:1: not JSON"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n[1]',
     "in.jsonl:2: a line must be a JSON object"),
    ('{"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {}}',
     "'custom_id' must be a string"),
])
def test_a_bad_input_file_is_refused_before_the_model_loads(tmp_path, text, message):
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    done = run_batch(["-i", str(src), "-o", str(tmp_path / "out.jsonl")], timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.jsonl").exists()


class _Files(http.server.BaseHTTPRequestHandler):
    """GET serves `files[path]`; PUT stores the body there."""
    files: dict[str, bytes] = {}

    def do_GET(self):
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self):
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.extended          # a server of its own
def test_input_and_output_over_http(tmp_path):
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    _Files.files["/in.jsonl"] = (line("x", "/v1/completions", COMPLETION) + "\n").encode()
    try:
        done = run_batch(["-i", f"{base}/in.jsonl", "-o", f"{base}/out.jsonl"])
        assert done.returncode == 0, done.stderr[-3000:]
        out = [json.loads(x) for x in _Files.files["/out.jsonl"].decode().splitlines()]
        assert [o["custom_id"] for o in out] == ["x"] and out[0]["error"] is None
        missing = run_batch(["-i", f"{base}/missing.jsonl", "-o", str(tmp_path / "o.jsonl")],
                            timeout=60)
        assert missing.returncode == 2 and "cannot read" in missing.stderr
    finally:
        files.shutdown()
