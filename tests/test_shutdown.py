"""Stopping `continuum serve` as an operator does — SIGTERM from a supervisor, Ctrl-C in a
terminal (SIGINT to the whole process group, engine process included) — and losing the engine
process. Real server processes, real clients:

- a drain (`--shutdown-timeout`): readiness 503 on both protocols at once, new requests 503 in
  each protocol's shape, in-flight requests (stream and not) finish exactly, exit status 0;
- past the timeout (default 0) what is in flight ends with finish_reason "abort" (streams then
  `[DONE]`); a second signal stops at once;
- a killed engine: every in-flight request gets an error within a second, liveness 503, the
  server exits non-zero within a few seconds;
- a python model whose code never returns (execute, finalize) does not keep the server from
  exiting;
- never a traceback in the log.
"""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL, metric, simple_repository, start_server

ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.1", "--uvicorn-log-level", "warning"]


def _complete(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


class InFlight(threading.Thread):
    """One request in a thread: a streamed chat completion (events kept) or a plain completion
    (the response kept); `ended` is the monotonic time its response was complete."""

    def __init__(self, base: str, max_tokens: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens, self.stream = base, max_tokens, stream
        self.events: list[str] = []
        self.response = None
        self.error: BaseException | None = None
        self.ended = None
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0}
        try:
            if self.stream:
                body |= {"messages": [{"role": "user", "content": "Tell me a long story."}],
                         "stream": True, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=body,
                                  timeout=120) as r:
                    self.response = r
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:])
            else:
                body["prompt"] = "Write an essay about the sea."
                self.response = httpx.post(f"{self.base}/v1/completions", json=body,
                                           timeout=120)
        except httpx.HTTPError as e:
            self.error = e
        self.ended = time.monotonic()

    def chunks(self) -> list[dict]:
        """The stream's JSON chunks (without `[DONE]`)."""
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _start(base: str, specs: list[tuple[int, bool]]) -> list[InFlight]:
    """Start the requests and wait until the engine runs all of them and the streams flow."""
    reqs = [InFlight(base, n, stream) for n, stream in specs]
    deadline = time.time() + 60
    while time.time() < deadline:
        running = metric(base, "continuum_num_requests_running")
        if running >= len(reqs) and all(len(r.events) > 2 for r in reqs if r.stream):
            return reqs
        time.sleep(0.05)
    raise AssertionError("the requests did not start")


def _finish_reason(req: InFlight) -> str:
    if req.stream:
        reasons = [c["choices"][0]["finish_reason"] for c in req.chunks() if c.get("choices")]
        return [r for r in reasons if r][-1]
    return req.response.json()["choices"][0]["finish_reason"]


def _no_traceback(log) -> str:
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "ready in" in text                 # the log is the server's, read to its end
    return text


@pytest.mark.parametrize("how", [
    pytest.param("sigterm", marks=pytest.mark.extended), "ctrl-c",
    # 50 ms apart, as an impatient operator or `timeout` + `kill` send them: the first
    # signal's drain (timeout 0) has set the server stopping when the next arrives, and its
    # shutdown (~0.2 s: uvicorn's pauses, the engine's stop) has not finished
    "ctrl-c twice", pytest.param("sigterm three times", marks=pytest.mark.extended)])
def test_stop_exits_0_without_traceback(tmp_path, how):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)
    try:
        _complete(base)
        # the engine core checked the flags that need torch (engine/flag_checks.py): the API
        # process answers without ever loading it (~2 s of its start)
        assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
        times = {"twice": 2, "three times": 3}.get(how.partition(" ")[2], 1)
        for i in range(times):
            time.sleep(0.05 if i else 0)
            if how.startswith("sigterm"):
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _no_traceback(log)


@pytest.mark.slow
def test_drain_finishes_in_flight_requests_and_refuses_new_ones(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server([*ARGS, "--shutdown-timeout", "60", "--model-repository",
                               simple_repository(tmp_path)], "/health/ready", log,
                              new_session=True)
    try:
        stream, plain = _start(base, [(80, True), (60, False)])
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.2)
        assert httpx.get(f"{base}/health/ready", timeout=5).status_code == 503
        assert httpx.get(f"{base}/v2/health/ready", timeout=5).status_code == 400   # as Triton
        r = httpx.post(f"{base}/v1/completions", timeout=5,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        r = httpx.post(f"{base}/v2/models/simple/infer", timeout=5, json={"inputs": []})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]
        assert time.monotonic() - t0 < 2 and stream.ended is None, "refusals waited"
        stream.join(60)
        plain.join(60)
        assert stream.events[-1] == "[DONE]"
        assert stream.chunks()[-1]["usage"]["completion_tokens"] == 80
        assert _finish_reason(stream) == "length"
        assert plain.response.status_code == 200
        assert plain.response.json()["usage"]["completion_tokens"] == 60
        assert _finish_reason(plain) == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = _no_traceback(log)
    assert "SIGTERM: draining 2 request(s)" in text


@pytest.mark.extended        # the drain test above keeps the drain in make test
def test_past_the_timeout_in_flight_requests_end_as_aborted(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)   # timeout 0
    try:
        stream, plain = _start(base, [(400, True), (400, False)])
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        stream.join(30)
        plain.join(30)
        assert stream.ended - t0 < 2 and plain.ended - t0 < 2
        assert stream.events[-1] == "[DONE]" and _finish_reason(stream) == "abort"
        assert 0 < stream.chunks()[-1]["usage"]["completion_tokens"] < 400
        assert plain.response.status_code == 200 and _finish_reason(plain) == "abort"
        assert 0 < plain.response.json()["usage"]["completion_tokens"] < 400
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "aborting 2 request(s) still in flight" in _no_traceback(log)


@pytest.mark.extended
def test_a_second_signal_stops_at_once(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server([*ARGS, "--shutdown-timeout", "120"], "/health/ready", log,
                              new_session=True)
    try:
        _start(base, [(450, True)])
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None                # draining: the stream has 120 s
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "second signal: stopping now" in _no_traceback(log)


@pytest.mark.extended      # ~19 s; the drain and Ctrl-C tests stay in make test
def test_engine_death_fails_in_flight_requests_and_exits_non_zero(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)
    try:
        stream, plain = _start(base, [(400, True), (400, False)])
        children = [int(p) for p in
                    open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert children, "the engine runs in a child process"
        t0 = time.monotonic()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        stream.join(10)
        plain.join(10)
        assert stream.ended - t0 < 1.5 and plain.ended - t0 < 1.5
        assert stream.events[-1] == "[DONE]" and "error" in json.loads(stream.events[-2])
        assert plain.response.status_code == 500 and "error" in plain.response.json()
        try:                                      # not live (if it still answers at all)
            assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        except (httpx.ConnectError, httpx.RemoteProtocolError):   # closed, or closing on us
            pass
        assert proc.wait(10) != 0
        assert time.monotonic() - t0 < 8
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = _no_traceback(log)
    assert "engine process exited unexpectedly (exit code -9)" in text


@pytest.mark.extended          # ~15 s; make test keeps the drain and the clean stop
def test_a_model_that_never_returns_does_not_hold_the_exit(tmp_path):
    """A request is stuck in a python model's execute (and its finalize would wait forever
    too): SIGTERM still ends the server within its bounded shutdown, with status 0 and no
    traceback; the stuck request's connection is closed."""
    from pathlib import Path

    repo = tmp_path / "repo"
    (repo / "stuck" / "1").mkdir(parents=True)
    (repo / "stuck" / "1" / "model.py").symlink_to(
        Path(__file__).parent / "triton_models" / "stuck_model.py")
    (repo / "stuck" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 0 input [ { name: "IN" data_type: TYPE_INT32 '
        'dims: [ 1 ] } ] output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]')
    log = tmp_path / "server.log"
    proc, base = start_server(["--no-llm", "--model-repository", str(repo),
                               "--uvicorn-log-level", "warning"], "/v2/health/ready", log,
                              new_session=True)
    try:
        def stuck_request():
            try:
                httpx.post(f"{base}/v2/models/stuck/infer", timeout=120, json={"inputs": [
                    {"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]})
            except httpx.HTTPError:
                pass
        worker = threading.Thread(target=stuck_request, daemon=True)
        worker.start()
        time.sleep(1.0)                          # the request is in execute now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        worker.join(10)
        assert not worker.is_alive()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "an execution did not end" in text
