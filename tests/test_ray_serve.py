"""Data parallelism over Ray Serve, end to end: a real Ray cluster started by this test process
(`ray.init(num_cpus=2)`), `continuum serve --data-parallel-backend ray --num-replicas 2` joining
it, each replica the embedded model with one torch thread, its ingress on a loopback port.

- the official `openai` SDK streams through the ingress; greedy outputs equal those of a single
  `continuum serve` with the same flags; both replicas serve; `/metrics` has each replica's
  series and their sum;
- killing one replica's actor fails only the requests in flight on it (an SSE error event, then
  `[DONE]`); those on the other replica finish exactly; Ray starts a new replica; the app serves;
- on a shared-prefix workload the prefix-aware router gives a higher prefix-cache hit rate
  (read from each replica's counters) than random routing;
- SIGTERM to `continuum serve` deletes the app (replicas drain) and exits 0.

Minutes each (every app start loads two replicas): marked `stress`.
"""

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import MODEL, free_port, start_server, stop_server

ray = pytest.importorskip("ray", reason="needs ray[serve] (pip install -e '.[test]')")
serve = pytest.importorskip("ray.serve", reason="needs ray[serve] (pip install -e '.[test]')")

pytestmark = pytest.mark.stress
FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "0.1", "--uvicorn-log-level", "warning"]
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,",
           "Explain what a KV cache is.", "Name three colours:", "Once upon a time"]
PORT = free_port()          # Serve's HTTP proxy keeps its port for the cluster's lifetime


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs owned by this process; its GCS address."""
    info = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                    namespace="continuum-tests")
    yield info.address_info["gcs_address"]
    ray.shutdown()


def start_app(cluster: str, log_path, router: str = "prefix-aware"):
    """`continuum serve --data-parallel-backend ray` with 2 replicas joining `cluster`;
    returns (process, base URL) once `/health/ready` answers 200 on the ingress."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api", "serve", "--data-parallel-backend", "ray",
         "--num-replicas", "2", "--replica-num-cpus", "1", "--request-router", router,
         "--ray-address", cluster, "--host", "127.0.0.1", "--port", str(PORT),
         "--shutdown-timeout", "5", *FLAGS], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{PORT}"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if (httpx.get(f"{base}/health/ready", timeout=2).status_code == 200
                    and running_replicas() == 2):
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"app not ready: {open(log_path, 'rb').read()[-3000:]!r}")


def stop_app(proc) -> None:
    """SIGTERM: the app is deleted (replicas drain) and the process exits 0."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0


def running_replicas() -> int:
    """How many `ContinuumReplica` replicas are RUNNING, by Serve's status."""
    apps = serve.status().applications
    dep = apps["continuum"].deployments.get("ContinuumReplica") if "continuum" in apps else None
    return 0 if dep is None else dep.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A single `continuum serve` with the same flags and one torch thread: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        proc, base = start_server(FLAGS, "/health/ready",
                                  tmp_path_factory.mktemp("single") / "server.log")
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def app_process(cluster, tmp_path_factory):
    """(process, base URL) of the module's app (prefix-aware routing)."""
    proc, base = start_app(cluster, tmp_path_factory.mktemp("app") / "app.log")
    yield proc, base
    stop_app(proc)


@pytest.fixture
def app(app_process) -> str:
    """Base URL of the module's app."""
    return app_process[1]


def _chat(base: str, prompt: str, max_tokens: int = 16) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens <= max_tokens
    return "".join(parts)


def _complete(base: str, prompt: str, max_tokens: int = 16) -> tuple[str, str]:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers.get("x-continuum-replica", "")


def test_openai_sdk_streams_through_and_greedy_equals_a_single_server(app, single):
    for prompt in PROMPTS[:3]:
        assert _chat(app, prompt) == _chat(single, prompt)
    replicas = set()
    for prompt in PROMPTS:
        text, replica = _complete(app, prompt)
        assert text == _complete(single, prompt)[0]
        replicas.add(replica)
    assert len(replicas) == 2, replicas          # distinct prompts spread over both replicas


def test_metrics_per_replica_and_summed(app):
    _complete(app, "Hello", 2)
    time.sleep(2.5)                 # replicas publish their metrics every second
    text = httpx.get(f"{app}/metrics", timeout=10).text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^continuum_generation_tokens_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
    assert len(values) == 3 and "all" in values, values
    assert values["all"] == sum(v for k, v in values.items() if k != "all")


class Stream(threading.Thread):
    """A streamed chat completion in a thread: the replica that serves it, its events."""

    def __init__(self, base: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.prompt, self.max_tokens = base, prompt, max_tokens
        self.replica: str | None = None
        self.events: list[dict | str] = []
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=body,
                          timeout=300) as r:
            self.replica = r.headers.get("x-continuum-replica")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))


def _kill_replica(replica_id: str) -> None:
    name = f"SERVE_REPLICA::continuum#ContinuumReplica#{replica_id}"
    ray.kill(ray.get_actor(name, namespace="serve"))


def test_killing_a_replica_fails_only_its_requests_and_ray_restarts_it(app):
    streams: list[Stream] = []
    for i in range(8):                         # until both replicas have a stream in flight
        # no shared prefix: the router spreads them by the text each replica holds
        streams.append(Stream(app, f"{uuid.uuid4().hex} story {i}: tell me a long tale.", 300))
        time.sleep(0.5)
        if len({s.replica for s in streams if s.replica}) == 2:
            break
    deadline = time.time() + 60
    while time.time() < deadline and not all(len(s.events) > 3 for s in streams):
        time.sleep(0.2)
    replicas = {s.replica for s in streams}
    assert len(replicas) == 2 and None not in replicas
    victim = sorted(replicas)[0]
    _kill_replica(victim)
    for s in streams:
        s.join(300)
        assert not s.is_alive()
        assert s.events[-1] == "[DONE]"
        last = s.events[-2]
        if s.replica == victim:
            assert last["error"]["code"] == "replica_failed", last
        else:
            finished = [e for e in s.events[:-1] if e["choices"]
                        and e["choices"][0].get("finish_reason")]
            assert finished[-1]["choices"][0]["finish_reason"] == "length"
            # all 300 tokens: counted by the usage chunk, not by deltas (a client that lags
            # gets several tokens merged into one delta, more of them on a busier host)
            assert last["usage"]["completion_tokens"] == 300, last
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in s.events[:-1]
                           if e["choices"])
    assert _complete(app, "The capital of France is", 4)[0]      # the app still serves
    deadline = time.time() + 300
    while time.time() < deadline and running_replicas() < 2:
        time.sleep(1)
    assert running_replicas() == 2            # Ray replaced the killed replica
    # the ingress learns of the new replica from the controller a moment later: poll until
    # it serves (unmatched prompts go to the replica holding the least prompt text)
    served: set[str] = set()
    deadline = time.time() + 60
    while time.time() < deadline and len(served - replicas) == 0:
        served.add(_complete(app, f"{uuid.uuid4().hex} is a", 2)[1])
        time.sleep(0.5)
    assert victim not in served and len(served - replicas) == 1, served
    assert httpx.get(f"{app}/health", timeout=5).status_code == 200


def _prefix_counters(base: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over replicas (ingress /metrics)."""
    time.sleep(2.5)                 # replicas publish their metrics every second
    text = httpx.get(f"{base}/metrics", timeout=10).text

    def total(name: str) -> float:
        m = re.search(rf'^{name}\{{[^}}]*replica="all"[^}}]*\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0
    return total("continuum_prefix_cache_hits_total"), total("continuum_prefix_cache_queries_total")


def _shared_prefix_workload(base: str, groups: int = 4, per_group: int = 6) -> float:
    """Requests of `groups` long shared prefixes (each a few hundred tokens) with different
    questions, groups interleaved, one at a time; the prefix-cache hit rate they got."""
    hits0, queries0 = _prefix_counters(base)
    tag = uuid.uuid4().hex
    prefixes = [f"Document {g} ({tag}). " + " ".join(
        f"Paragraph {i} of document {g} says the value of item {i} is {i * (g + 3)}."
        for i in range(18)) for g in range(groups)]
    for q in range(per_group):
        for prefix in prefixes:
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": f"{prefix}\nQuestion {q}: what is item {q}?",
                "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
    hits1, queries1 = _prefix_counters(base)
    return (hits1 - hits0) / (queries1 - queries0)


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_random(app_process, cluster,
                                                                     tmp_path_factory):
    """Last in the module: it stops the module's app (exit 0 after SIGTERM) to run the same
    workload on an app with random routing (the cluster has room for two replicas)."""
    prefix_aware = _shared_prefix_workload(app_process[1])
    stop_app(app_process[0])
    proc, base = start_app(cluster, tmp_path_factory.mktemp("random") / "app.log", "random")
    try:
        random_rate = _shared_prefix_workload(base)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    finally:
        stop_app(proc)
    print(f"prefix-cache hit rate: prefix-aware {prefix_aware:.3f}, random {random_rate:.3f}")
    assert prefix_aware > random_rate + 0.05, (prefix_aware, random_rate)
