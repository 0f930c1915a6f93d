"""`continuum serve --api-server-count 2` (vLLM's flag) as users run it: two API processes over
one engine core behind one port. Concurrent OpenAI SDK clients get what one process gives
(float32: batch-invariant), the shared /metrics counts every request and token once whichever
process answers the scrape, a LoRA adapter loaded through one process is listed and served by
both, SIGINT drains all and exits 0 without a traceback, and an engine core that dies takes the
whole server down with status 1. Bad combinations are one-line start errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import MODEL, metric, start_server

ARGS = ["--api-server-count", "2", "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory", "0.1", "--uvicorn-log-level", "warning"]
PROMPTS = [f"Question {i}: name a colour." for i in range(12)]      # < one block: no prefix hits


def _both_ready(log, proc, timeout: float = 120) -> tuple[list[int], int]:
    """Wait until both API processes logged ready; (API pids, engine core pid)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        text = log.read_text()
        if "API process 1 of 2" in text and "API process 2 of 2" in text:
            m = re.search(r"pids (\d+), (\d+); engine core (\d+)", text)
            return [int(m.group(1)), int(m.group(2))], int(m.group(3))
        time.sleep(0.3)
    raise AssertionError(f"not both ready: {log.read_text()[-2000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _served(pid: int, name: str, **labels) -> float:
    """API process `pid`'s own part of counter `name` (its prometheus-client multiprocess
    files): what it served."""
    from glob import glob

    from prometheus_client.multiprocess import MultiProcessCollector
    env = dict(kv.split("=", 1) for kv in
               open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    files = glob(os.path.join(env["PROMETHEUS_MULTIPROC_DIR"], f"counter_{pid}.db"))
    return sum(s.value for m in MultiProcessCollector.merge(files) for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _complete(base: str, prompt: str, model: str = MODEL) -> tuple[str, int, int]:
    """A greedy completion over a connection of its own: (text, prompt tokens, completion
    tokens)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    client.close()
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens


@pytest.mark.slow
@pytest.mark.extended                # ~60 s, a server of its own: CI's stress tier
def test_two_api_processes_serve_one_engine(tmp_path, model_dir):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
    assert peft
    from tests.test_lora import SPECS, make_adapter
    adapter = tmp_path / "attn8"
    make_adapter(model_dir, adapter, *SPECS["attn8"])
    log = tmp_path / "server.log"
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        proc, base = start_server([*ARGS, "--enable-lora", "--max-loras", "1"],
                                  "/health/ready", log, new_session=True)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    try:
        apis, core = _both_ready(log, proc)
        alone = [_complete(base, p) for p in PROMPTS[:4]]           # one at a time
        before = {k: metric(base, f"continuum_{k}") for k in
                  ("request_success_total", "generation_tokens_total", "prompt_tokens_total")}
        with ThreadPoolExecutor(12) as pool:                        # 12 connections at once
            together = list(pool.map(lambda p: _complete(base, p), PROMPTS))
        assert together[:4] == alone
        for _ in range(5):            # until the kernel has handed both some connections
            if all(_served(pid, "continuum_request_success_total") > 1 for pid in apis):
                break                 # (1: the warm-up)
            with ThreadPoolExecutor(12) as pool:
                assert list(pool.map(lambda p: _complete(base, p), PROMPTS)) == together
        assert all(_served(pid, "continuum_request_success_total") > 1 for pid in apis)
        done = sum(_served(pid, "continuum_request_success_total") for pid in apis)
        for _ in range(4):            # whichever process answers, the sums are the same
            assert metric(base, "continuum_request_success_total") == done
            rounds = (done - before["request_success_total"]) / len(PROMPTS)
            assert metric(base, "continuum_generation_tokens_total") \
                - before["generation_tokens_total"] == rounds * sum(c for _, _, c in together)
            assert metric(base, "continuum_prompt_tokens_total") \
                - before["prompt_tokens_total"] == rounds * sum(p for _, p, _ in together)
            assert metric(base, "continuum_num_requests_running") == 0
        r = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "attn8", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        for _ in range(40):           # fresh connections: both processes list and serve it
            models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
            assert "attn8" in [m["id"] for m in models]
            assert _complete(base, PROMPTS[0], "attn8")[0] != alone[0][0]
            if all(_served(pid, "continuum_lora_request_success_total", lora_name="attn8")
                   for pid in apis):
                break
        assert all(_served(pid, "continuum_lora_request_success_total", lora_name="attn8")
                   for pid in apis)
        assert _complete(base, PROMPTS[0]) == alone[0]              # live after all that
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert not any(_alive(pid) for pid in [*apis, core])


@pytest.mark.slow
@pytest.mark.extended
def test_engine_core_death_stops_every_api_process(tmp_path):
    log = tmp_path / "server.log"
    proc, base = start_server(ARGS, "/health/ready", log, new_session=True)
    try:
        apis, core = _both_ready(log, proc)
        os.kill(core, signal.SIGKILL)
        assert proc.wait(30) == 1
        assert not any(_alive(pid) for pid in apis)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "engine process exited unexpectedly" in log.read_text()


@pytest.mark.parametrize("extra, words", [       # ~0.2 s a refusal (no torch loaded)
    (["--api-server-count", "0"], "--api-server-count must be >= 1"),
    (["--api-server-count", "2", "--model-repository", "examples/model_repository"],
     "cannot be used with --model-repository"),
    (["--api-server-count", "2", "--metrics-port", "9400"],
     "cannot be used with --metrics-port"),
])
def test_bad_combinations_are_one_line_start_errors(extra, words):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "api", "serve", *extra], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_core_routes_each_message_to_its_api_process():
    """engine/core_clients.py over real pipes: 600 requests from two front ends (past two
    prunings of finished owners), one step's outputs (a forked choice among them) each to its
    owner, the engine-wide stats and snapshot to front end 0 alone, an acknowledgement to the
    sender, AbortAll aborting the sender's requests only, leaving front ends."""
    from multiprocessing import Pipe

    from engine.core_clients import ClientOutbox, ClientPipes
    from engine.messages import AbortAll, AbortRequests, Acknowledged, AddRequest, Stop
    from engine.outputs import EngineCoreOutputs, StepStats
    from scheduler.output import RequestStepOutput
    from scheduler.request import RequestStatus, SamplingParams

    pairs = [Pipe() for _ in range(2)]
    pipes = ClientPipes([core for _, core in pairs])
    outbox = ClientOutbox([core for _, core in pairs], pipes)
    live: set[str] = set()
    pipes.live_requests = lambda: live

    def take(client, message):
        pairs[client][0].send(message)
        pipes.wait()
        assert pipes.poll()
        return pipes.recv()

    for i in range(600):
        command = take(i % 2, AddRequest(f"r{i}", [1, 2], SamplingParams(), 0.0))
        live.add(command.request_id)
        if i == 7:
            outbox(Acknowledged("r7"))
            assert pairs[1][0].recv().call_id == "r7" and not pairs[0][0].poll(0)
    outputs = [RequestStepOutput(f"r{i}", [5], RequestStatus.RUNNING) for i in range(600)]
    outputs.append(RequestStepOutput("r9#1", [6], RequestStatus.RUNNING, parent_id="r9", index=1))
    outbox(EngineCoreOutputs(outputs=outputs, scheduled=[("r3", 1.0, 0), ("r4", 1.0, 16)],
                             stats=StepStats(600, 600, 0, 0.1, 0.01), snapshot={"x": 1}))
    first, second = pairs[0][0].recv(), pairs[1][0].recv()
    assert [o.request_id for o in first.outputs] == [f"r{i}" for i in range(0, 600, 2)]
    assert [o.request_id for o in second.outputs] == [f"r{i}" for i in range(1, 600, 2)] + ["r9#1"]
    assert first.scheduled == [("r4", 1.0, 16)] and second.scheduled == [("r3", 1.0, 0)]
    assert first.stats.batch_size == 600 and first.snapshot == {"x": 1}
    assert second.stats.engine_wide is False and second.snapshot is None
    abort = take(1, AbortAll())
    assert isinstance(abort, AbortRequests)
    assert sorted(abort.request_ids) == sorted(f"r{i}" for i in range(1, 600, 2))
    gone = take(1, Stop())                         # front end 1 leaves: its requests aborted
    assert isinstance(gone, AbortRequests) and len(gone.request_ids) == 300
    pairs[0][0].close()                            # front end 0's process exits: the core stops
    assert isinstance(take_closed(pipes), Stop)


def take_closed(pipes):
    """The command a closed pipe becomes."""
    pipes.wait()
    assert pipes.poll()
    return pipes.recv()
