"""v2 infer over the HTTP/1.1 wire, as a client's socket sees it: pipelined requests answered in
order (a slow model's before a cheap one's sent after it on the same connection), a chunked
body, a client that leaves mid-inference, CORS, and a drain with an infer in flight.

Continuum answers most v2 infers below ASGI (api/http_protocol.py, `InferRoute` in
triton_compat/frontend/http_infer.py) and the rest through the ASGI stack; these tests hold
both to HTTP/1.1 and to tritonserver 2.51's answers (they run on both servers, see
tests/v2_target.py), every one ending with a liveness check.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.triton_servers import EXAMPLES, seq_model
from tests.v2_target import ON_TRITON, continuum_only, start_v2_server, stop_v2_server


def _infer_body(name: str, value: int) -> bytes:
    data = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, 1], "data": [value]}]}
    if name == "simple":
        data = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16],
                            "data": [value] * 16} for n in ("INPUT0", "INPUT1")]}
    return json.dumps(data).encode()


def _post(model: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def _responses(sock: socket.socket, count: int, timeout: float = 30) -> list[tuple]:
    """`count` HTTP/1.1 responses read off `sock`: (status, lower-case headers, body)."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < count:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            lines = buf[:head_end].decode("latin-1").split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:])
            headers = {k.lower(): v for k, v in headers.items()}
            end = head_end + 4 + int(headers.get("content-length", 0))
            if len(buf) >= end:
                out.append((int(lines[0].split()[1]), headers, buf[head_end + 4:end]))
                buf = buf[end:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(out)} of {count} responses"
        buf += chunk
    return out


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _alive(base: str) -> None:
    r = httpx.post(f"{base}/v2/models/simple/infer", content=_infer_body("simple", 2),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [4] * 16


def _out(body: bytes, name: str = "OUT") -> list:
    return next(o["data"] for o in json.loads(body)["outputs"] if o["name"] == name)


def test_pipelined_requests_are_answered_in_order(v2_servers):
    base = v2_servers["main"][0]
    with _connect(base) as sock:
        # the slow model first: the cheap infers behind it must wait for its answer
        sock.sendall(_post("delayed", _infer_body("delayed", 7))
                     + _post("simple", _infer_body("simple", 3))
                     + _post("simple", _infer_body("simple", 5)))
        answers = _responses(sock, 3)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert _out(answers[0][2]) == [7]
    assert _out(answers[1][2], "OUTPUT0") == [6] * 16
    assert _out(answers[2][2], "OUTPUT1") == [0] * 16
    _alive(base)


@continuum_only("tritonserver 2.51 never answers a request pipelined behind a GET or behind "
                "an error answer (measured: the connection stalls)")
def test_pipelined_behind_a_get_and_errors(v2_servers):
    base = v2_servers["main"][0]
    with _connect(base) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
                     + _post("nope", _infer_body("simple", 1))
                     + _post("simple", b"{not json")
                     + _post("simple", _infer_body("simple", 5)))
        answers = _responses(sock, 4)
    assert [a[0] for a in answers] == [200, 404, 400, 200]
    assert "nope" in json.loads(answers[1][2])["error"]
    assert _out(answers[3][2], "OUTPUT0") == [10] * 16
    _alive(base)


def test_a_chunked_body_then_errors_on_one_connection(v2_servers):
    base = v2_servers["main"][0]
    body = _infer_body("simple", 4)
    chunked = (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + f"{10:x}\r\n".encode() + body[:10] + b"\r\n"
               + f"{len(body) - 10:x}\r\n".encode() + body[10:] + b"\r\n0\r\n\r\n")
    answers = []
    with _connect(base) as sock:       # one request at a time: each answered on the same
        for request in (chunked, _post("nope", body), _post("simple", body)):   # connection
            sock.sendall(request)
            answers += _responses(sock, 1)
    assert answers[0][0] == 200 and _out(answers[0][2], "OUTPUT0") == [8] * 16
    assert answers[1][0] == 404 and "nope" in json.loads(answers[1][2])["error"]
    assert answers[2][0] == 200 and _out(answers[2][2], "OUTPUT1") == [0] * 16
    _alive(base)


def test_a_client_that_leaves_mid_inference_costs_no_one_else(v2_servers):
    base = v2_servers["main"][0]
    for _ in range(3):
        sock = _connect(base)
        sock.sendall(_post("delayed", _infer_body("delayed", 1)))
        sock.close()                      # gone while the model runs (300 ms)
    with _connect(base) as sock:         # a half-sent body, then gone
        sock.sendall(_post("simple", _infer_body("simple", 1))[:-5])
    time.sleep(1.2)                      # the abandoned executions end
    with _connect(base) as sock:
        sock.sendall(_post("delayed", _infer_body("delayed", 9)))
        (status, _, body), = _responses(sock, 1)
    assert status == 200 and _out(body) == [9]
    _alive(base)


@continuum_only("CORS is vLLM's --allowed-origins; tritonserver has no CORS")
def test_a_browser_request_gets_the_cors_headers(v2_servers):
    base = v2_servers["main"][0]
    r = httpx.post(f"{base}/v2/models/simple/infer", content=_infer_body("simple", 1),
                   headers={"Origin": "http://example.com"}, timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2] * 16
    assert r.headers["access-control-allow-origin"] == "*"
    _alive(base)


@continuum_only("Continuum's drain (--shutdown-timeout) and its log line")
def test_a_drain_waits_for_an_infer_in_flight(tmp_path):
    root = tmp_path / "repo"
    seq_model(root, "slow", "", 1500)
    log = tmp_path / "server.log"
    proc, base = start_server(["--no-llm", "--model-repository", str(root),
                               "--shutdown-timeout", "30"], "/v2/health/ready", log,
                              new_session=True)
    try:
        with _connect(base) as sock:
            sock.sendall(_post("slow", _infer_body("slow", 4)))
            time.sleep(0.5)              # executing
            proc.send_signal(signal.SIGTERM)
            (status, _, body), = _responses(sock, 1)
        assert status == 200 and _out(body) == [4]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "draining 1 request(s)" in text and "Traceback" not in text


@pytest.mark.parametrize("model", ["simple", "delayed"])
def test_a_response_on_a_connection_that_asked_to_close(v2_servers, model):
    base = v2_servers["main"][0]
    with _connect(base) as sock:
        sock.sendall(_post(model, _infer_body(model, 2), "Connection: close\r\n"))
        (status, headers, body), = _responses(sock, 1)
        assert status == 200
        sock.settimeout(10)
        assert sock.recv(1) == b""        # the server closed it after the response
    _alive(base)


@pytest.mark.extended         # a model slower than uvicorn's 5 s keep-alive timeout
@continuum_only("a request past uvicorn's keep-alive timeout behind an answered one")
def test_a_slow_request_pipelined_behind_an_answered_one_is_not_cut(tmp_path):
    root = tmp_path / "repo"
    seq_model(root, "slow", "", 5600)
    (root / "simple").symlink_to(Path(__file__).resolve().parent.parent
                                 / "examples/model_repository/simple")
    proc, base = start_server(["--no-llm", "--model-repository", str(root)],
                              "/v2/health/ready", tmp_path / "server.log")
    try:
        for _ in range(20):              # simple measured cheap: it then runs inline
            _alive(base)
        with _connect(base) as sock:    # simple answered at once, then 5.6 s of `slow`
            sock.sendall(_post("simple", _infer_body("simple", 1))
                         + _post("slow", _infer_body("slow", 6)))
            answers = _responses(sock, 2)
        assert [a[0] for a in answers] == [200, 200]
        assert _out(answers[1][2]) == [6]
        _alive(base)
    finally:
        proc.terminate()
        proc.wait(30)


def _access_lines(log: Path) -> list[str]:
    """uvicorn's access lines in a server log, without the client's address."""
    return [line.split(" - ", 1)[1] for line in log.read_text().splitlines()
            if ' HTTP/1.1" ' in line and " - " in line]


@continuum_only("uvicorn's access log; tritonserver writes none at its default verbosity")
def test_v2_requests_get_access_lines_only_when_verbose(tmp_path):
    """As tritonserver, nothing is logged per v2 request at the default verbosity (a line
    cost the HTTP path 12-47 % of its rate); `--log-verbose 1`, here set at run time through
    the logging extension, brings uvicorn's access lines back, the same for an infer the
    protocol answered and one through the ASGI layers (an Origin header). The other routes
    keep theirs at any level, as `vllm serve`."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "simple").symlink_to(EXAMPLES / "simple")
    proc, base = start_server(["--no-llm", "--model-repository", str(root)],
                              "/v2/health/ready", tmp_path / "server.log")
    origin = {"Origin": "http://example.com"}
    try:
        assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200
        for headers in ({}, origin):
            r = httpx.post(f"{base}/v2/models/simple/infer", content=_infer_body("simple", 1),
                           headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v2/logging", json={"log_verbose_level": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["log_verbose_level"] == 1, r.text
        for headers in ({}, origin):
            r = httpx.post(f"{base}/v2/models/simple/infer", content=_infer_body("simple", 3),
                           headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        _alive(base)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = _access_lines(tmp_path / "server.log")
    # the infers after the change (the alive check's makes three); the logging POST itself
    # was claimed before the level changed: no line
    assert lines == ['"GET /metrics HTTP/1.1" 200 OK'] + \
        ['"POST /v2/models/simple/infer HTTP/1.1" 200 OK'] * 3, lines


def _process_ticks(pid: int) -> int:
    """A process's user + system time over all its threads, clock ticks."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_server_idle_after_back_to_back_infers_spends_no_cpu(tmp_path, monkeypatch):
    """While requests follow each other closely, Continuum's event loop polls its sockets and
    a halt-polling thread keeps the other CPUs awake (api/http_protocol.py `BusyPoll`,
    engine/halt_poll.py; forced on here, whatever the host): once they stop, both stop. 300
    back-to-back infers on one connection, then one idle second costs the server process no
    CPU to speak of — a server still polling would burn the whole second."""
    monkeypatch.setenv("CONTINUUM_HALT_POLL", "1")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "simple").symlink_to(EXAMPLES / "simple", target_is_directory=True)
    server = start_v2_server(tmp_path / "repo", tmp_path / "server.log")
    try:
        with _connect(server.http) as sock:
            for i in range(300):
                sock.sendall(_post("simple", _infer_body("simple", i)))
                (status, _, body), = _responses(sock, 1)
                assert status == 200 and _out(body, "OUTPUT0") == [2 * i] * 16
        time.sleep(0.05)                     # any polling window has ended by now
        idle = _process_ticks(server.proc.pid)
        time.sleep(1.0)
        assert _process_ticks(server.proc.pid) - idle <= 0.05 * os.sysconf("SC_CLK_TCK")
        _alive(server.http)
    finally:
        stop_v2_server(server)
    if not ON_TRITON:
        assert "halt polling on: CONTINUUM_HALT_POLL=1" in (tmp_path / "server.log").read_text()
