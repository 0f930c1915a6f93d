"""Which server the end-to-end v2 tests talk to, and what differs between the two on purpose.

The v2 tests (HTTP, gRPC, shared memory, sequence, decoupled, generate, statistics, errors)
start their server through `start_v2_server`. By default that is Continuum (`python -m api
serve`). With `CONTINUUM_V2_TARGET=triton` it is tritonserver 2.51 from the `nvidia-pytriton`
package in `TRITON_VENV` (default `.venv-triton`, made by `make test-conformance`) on the same
repository, so the same assertions are checked against the reference (python-backend models
only: the package ships no other backend).

Markers keep the suites honest on both servers:
- `continuum_only(reason)`: the test needs what Triton 2.51 cannot give it (the LLM, another
  backend, a Continuum-only flag); skipped on Triton with the reason.
- `deviation(key, continuum=..., triton=...)`: the value a test expects where Continuum differs
  from Triton on purpose; `DEVIATIONS[key]` says why, and docs/triton-conformance.md lists every
  key (tests/test_v2_target.py keeps the two in step).
- `differs(key)`: a test of deviation `key` whose Triton side cannot be asserted; skipped on
  Triton, naming the deviation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
TARGET = os.environ.get("CONTINUUM_V2_TARGET", "continuum")
if TARGET not in ("continuum", "triton"):
    raise ValueError(f"CONTINUUM_V2_TARGET must be continuum or triton, got {TARGET!r}")
ON_TRITON = TARGET == "triton"
TRITON_VENV = Path(os.environ.get("TRITON_VENV", ROOT / ".venv-triton"))

# Every deliberate difference from tritonserver 2.51 a test asserts: key -> the reason.
# docs/triton-conformance.md has one row per key (tests/test_v2_target.py checks).
DEVIATIONS = {
    "client-error-4xx":
        "A client's malformed request (JSON that does not parse, a value of the wrong JSON "
        "type, a data count that does not match its shape, a shared-memory key that does not "
        "exist, an unknown log_format) is answered 400 / INVALID_ARGUMENT with Triton's text, "
        "where tritonserver 2.51 answers 500 / INTERNAL (503 for the log_format): a 5xx tells "
        "clients, load balancers and fuzzers that the server failed.",
    "load-failure-reason":
        "A model load that fails (a config that does not parse or does not validate, an "
        "unknown model) is answered 400 (404 for an unknown model) with the reason; tritonserver "
        "2.51 answers 500 'failed to load ..., failed to poll from model repository' and only "
        "logs the reason.",
    "preferred-batch-growth":
        "Continuum forms a dynamic batch when an instance is free, so batches are preferred "
        "sizes when enough requests wait; tritonserver 2.51 forms the next batch while the "
        "instance is busy and keeps adding requests to it up to max_batch_size (12 requests "
        "on preferred size 4: batches of 4, 5 and 3).",
    "python-implicit-state":
        "A python-backend model that returns a tensor named as a state's output updates that "
        "implicit state; tritonserver 2.51's python backend has no state API and drops it, so "
        "a python model's state stays at its initial value. A model that does not return it "
        "keeps its state, as in Triton.",
    "generate-one-response":
        "/generate on a model that sends zero or several responses answers 400 with Triton's "
        "text; tritonserver 2.51 answers 200 with the error as the body (its response had "
        "started), which clients read as success.",
    "reschedule-refused":
        "A request a non-iterative model releases with RESCHEDULE fails with Triton core's "
        "error; tritonserver 2.51 never answers it (the request hangs).",
    "string-corrid":
        "A model whose CORRID control is TYPE_STRING gets the request's string id; "
        "tritonserver 2.51 sizes that tensor at 132 bytes whatever the id's length and refuses "
        "every such request ('unexpected number of string elements 2 for inference input "
        "...').",
    "shm-same-key":
        "A second system shared-memory region on a key already registered registers; "
        "tritonserver 2.51 reuses the file descriptor it closed after mapping the first and "
        "answers 500 'Invalid shared memory region'.",
    "generate-error-status":
        "A model's error response to /generate or as the first response of /generate_stream "
        "is sent with the error's own status (500 for a model's INTERNAL error); tritonserver "
        "2.51 reads that status after freeing the error (http_server.cc InferResponseComplete "
        "calls AddErrorJson, which deletes it, before HttpCodeFromError) and answers 400 in "
        "practice.",
    "integer-id-on-string-corrid":
        "An integer sequence id for a model whose CORRID control is TYPE_STRING is refused "
        "naming the mismatch; tritonserver 2.51 copies 132 bytes from the 8-byte id into the "
        "CORRID tensor and refuses it with a text that depends on memory contents.",
    "bls-self-call":
        "A BLS call that could never be served (every instance of its target is blocked "
        "calling that target, e.g. a one-instance model calling itself) gets an error "
        "response at once; tritonserver 2.51 blocks forever (its python backend README's "
        "limitation).",
    "dlpack-zero-copy":
        "pb_utils.Tensor.from_dlpack / to_dlpack share the tensor's memory on the CPU (one "
        "process); tritonserver 2.51's stub copies it into its shared memory.",
    "client-shm-off":
        "With client shared memory off (the default; --allow-client-shm turns it on) its APIs "
        "answer 403 over HTTP and UNAVAILABLE over gRPC, as Triton refuses a restricted API; "
        "Tritons that have the flag (newer than 2.51, which always allows it) answer 501 / "
        "UNIMPLEMENTED, which load balancers and fuzzers read as a server fault.",
    "model-output-checked":
        "A python model that does not return an output the client asked for fails that "
        "request with 500 naming the output; tritonserver 2.51 answers without it.",
    "classification-unsupported-type":
        "Classification asked of an output Triton cannot classify (BYTES) is refused with "
        "400 / INVALID_ARGUMENT and Triton's own text ('class result not available for "
        "output due to unsupported type ...'); tritonserver 2.51's server process dies on it "
        "(HTTP and gRPC: the connection closes, every model with it).",
    "ragged-padded-without-batch-input":
        "An onnxruntime / pytorch model with allow_ragged_batch inputs and no batch_input or "
        "batch_output gets them zero-padded to the longest request, batch dimension kept (a "
        "tokenizer's attention mask padded the same way is the mask); tritonserver 2.51 always "
        "concatenates them into one 1-D tensor, whose request boundaries such a model cannot "
        "find. With batch_input / batch_output declared, Continuum does as Triton.",
}


def continuum_only(reason: str):
    """Skip the test on tritonserver, saying why it cannot run there."""
    return pytest.mark.skipif(ON_TRITON, reason=f"Continuum only: {reason}")


def differs(key: str):
    """Skip the test on tritonserver: it asserts deviation `key`, whose Triton side cannot be
    asserted (a request that never ends, an answer that depends on memory contents)."""
    return pytest.mark.skipif(ON_TRITON, reason=f"deviation {key}: {DEVIATIONS[key]}")


def deviation(key: str, *, continuum, triton):
    """The expected value on the server under test where Continuum deviates from Triton on
    purpose (`key` must be in DEVIATIONS). Raises KeyError for an unlisted key."""
    DEVIATIONS[key]                    # noqa: B018 -- an unlisted deviation is a test bug
    return triton if ON_TRITON else continuum


@dataclass
class V2Server:
    """A live server: its process, HTTP base URL, gRPC address and /metrics URL."""

    proc: subprocess.Popen
    http: str
    grpc: str
    metrics: str


def _continuum_command(repo: Path, http: int, grpc: int, metrics: int,
                       opts: dict) -> list[str]:
    cmd = [sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository", str(repo),
           "--port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--uvicorn-log-level", "warning"]
    if opts.get("control_mode"):
        cmd += ["--model-control-mode", opts["control_mode"]]
    for name in opts.get("load_models", ()):
        cmd += ["--load-model", name]
    if opts.get("allow_client_shm", True):
        cmd += ["--allow-client-shm"]
    for rule in opts.get("grpc_restricted", ()):
        cmd += ["--grpc-restricted-protocol", rule]
    return cmd + list(opts.get("continuum_args", ()))


def _triton_command(repo: Path, http: int, grpc: int, metrics: int,
                    opts: dict) -> tuple[list[str], dict]:
    site = next((TRITON_VENV / "lib").glob("python3*/site-packages"), None)
    if site is None:
        raise RuntimeError(f"no tritonserver venv at {TRITON_VENV}: run `make test-conformance` "
                           "or set TRITON_VENV")
    ts = site / "pytriton" / "tritonserver"
    stub = ts / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():           # the stub built for the venv's python
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub.write_bytes((ts / "python_backend_stubs" / version /
                          "triton_python_backend_stub").read_bytes())
        stub.chmod(0o755)
    libs = [ts / "external_libs", ts / "lib", site / "nvidia_pytriton.libs"]
    env = dict(os.environ, PATH=f"{TRITON_VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
               LD_LIBRARY_PATH=":".join(map(str, libs)))
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(ts / "bin" / "tritonserver"), "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--backend-directory", str(ts / "backends"), "--exit-on-error=false"]
    if opts.get("control_mode"):
        cmd += [f"--model-control-mode={opts['control_mode']}"]
    for name in opts.get("load_models", ()):
        cmd += [f"--load-model={name}"]
    for rule in opts.get("grpc_restricted", ()):
        cmd += [f"--grpc-restricted-protocol={rule}"]
    return cmd + list(opts.get("triton_args", ())), env


def start_v2_server(repo: Path, log_path: Path, timeout: float = 180, **opts) -> V2Server:
    """Start the server under test on `repo` (free ports) and wait for /v2/health/ready.

    `opts`: control_mode ("explicit"), load_models (names), allow_client_shm (Continuum; always
    on in Triton 2.51), grpc_restricted (`--grpc-restricted-protocol` rules), continuum_args /
    triton_args (extra flags for one server only). Raises RuntimeError with the log's tail
    when the server exits or is not ready in `timeout` seconds."""
    import httpx

    http, grpc, metrics = free_port(), free_port(), free_port()     # three different ports
    if ON_TRITON:
        cmd, env = _triton_command(repo, http, grpc, metrics, opts)
    else:
        cmd, env = _continuum_command(repo, http, grpc, metrics, opts), dict(os.environ)
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"      # Triton's separate port
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{http}"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                return V2Server(proc, base, f"127.0.0.1:{grpc}", metrics_url)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{TARGET} not ready: {Path(log_path).read_text(errors='replace')[-3000:]}")


def stop_v2_server(server: V2Server) -> None:
    """Terminate the server and wait for it (killed after 30 s)."""
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


def wait_unloaded(client, name: str, timeout: float = 60) -> None:
    """Block until `name` is no longer READY or UNLOADING in the repository index of `client`
    (a tritonclient HTTP or gRPC client). Triton's unload returns while the model still unloads
    (TRITONSERVER_ServerUnloadModel does not wait), so a test that loads the same model next
    must wait, as a client of Triton must; Continuum's unload returns when it is done.
    Raises TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        index = client.get_model_repository_index()
        models = index if isinstance(index, list) else [
            {"name": m.name, "state": m.state} for m in index.models]
        state = next((m.get("state", "") for m in models if m["name"] == name), "")
        if state not in ("READY", "UNLOADING"):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"model {name!r} still {state} after {timeout} s")
        time.sleep(0.05)


def settled_stats(fetch, done, timeout: float = 5.0):
    """`fetch()` (a model's statistics) once `done(stats)` holds, or the last one after
    `timeout` seconds. tritonserver counts an inference when it releases the request, which
    can come after the client has the response (as with shared-memory regions); Continuum
    counts before it answers, so there the first fetch settles it."""
    deadline = time.monotonic() + timeout
    stats = fetch()
    while not done(stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = fetch()
    return stats
