"""Stopping `continuum serve` as an operator does — SIGTERM from a supervisor, Ctrl-C in a
terminal (SIGINT to the whole process group, engine process included) — and losing the engine
process: the server exits without a traceback in its log, and a dead engine is one error line
with liveness 503. Real server processes."""

import os
import signal
import time

import httpx
import pytest

from tests.conftest import start_server

ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.1", "--uvicorn-log-level", "warning"]


def _complete(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_stop_leaves_no_traceback(tmp_path, how):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)
    try:
        _complete(base)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "ready in" in text                 # the log is the server's, read to its end


def test_engine_death_is_one_error_line_and_liveness_503(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)
    try:
        _complete(base)
        children = [int(p) for p in
                    open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert children, "the engine runs in a child process"
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            if httpx.get(f"{base}/health", timeout=5).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code >= 500 and "error" in r.json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    text = log.read_text(errors="replace")
    assert "engine process exited unexpectedly (exit code -9)" in text
    assert "Traceback" not in text, text[-3000:]
