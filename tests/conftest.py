"""Session fixtures: the embedded model (converted once into the cache) and its tokenizer.

The model cache is `$CONTINUUM_CACHE` (default `~/.cache/continuum`), shared with `make serve`,
so a machine converts the GGUF once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import free_port  # noqa: F401  (tests import it from here)

# Triton's kernels run in its interpreter (numpy) where no GPU is: read when a kernel is defined,
# so it is set before any test imports one (tests/test_triton_attention.py).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 1024


@pytest.fixture(scope="session")
def model_dir():
    from engine.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# `lib`'s builds: name -> the kernel level whose `-march` flags it takes (`isa.march_flags`:
# the host's own level is -march=native, less what CONTINUUM_CPU_HIDE hides; avx512 on an AMX
# host is native without the AMX extensions)
KERNEL_BUILDS = {"native": None, "avx512-no-amx": "avx512", "avx2": "avx2",
                 "portable": "generic"}


def kernels_at(level: str):
    """The CPU kernels built with `level`'s `-march` flags (`isa.march_flags`; KERNEL_BUILDS'
    values) into the engine's kernel cache, loaded: an `engine.kernels.CpuKernels`. x86_64
    with a C compiler only (the callers skip elsewhere)."""
    import ctypes

    from engine import kernels
    from engine.kernels.isa import march_flags

    path = kernels.build(kernels.find_compiler(), kernels.BASE_CFLAGS + march_flags(level))
    return kernels.CpuKernels(ctypes.CDLL(str(path)))


@pytest.fixture(scope="session", params=list(KERNEL_BUILDS))
def lib(request):
    """The CPU kernels built each way this host runs them: its own (-march=native: AVX-512
    where it has it; on an AMX host, the quantized linears on tiles from AMX_MIN_ROWS rows of
    bfloat16 x), `avx512-no-amx` (the AMX extensions off, as under CONTINUUM_CPU_ISA=avx512;
    skipped without AMX), AVX2 + FMA (-march=x86-64-v3; skipped without AVX2) and portable
    (-march=x86-64-v2, the generic C loops); skipped without a C compiler."""
    import ctypes
    import platform

    from engine import kernels
    from engine.kernels.isa import LEVELS, host_isa

    compiler = kernels.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    if platform.machine() != "x86_64":
        if request.param != "native":
            pytest.skip("-march=x86-64-v* builds are for x86_64")
        return kernels.CpuKernels(ctypes.CDLL(str(kernels.build(compiler, kernels.BASE_CFLAGS))))
    if request.param == "avx2" and LEVELS.index(host_isa()) < LEVELS.index("avx2"):
        pytest.skip("this CPU has no AVX2 + FMA")
    if request.param == "avx512-no-amx" and host_isa() != "amx":
        pytest.skip("needs an AMX host (amx_tile, amx_bf16, avx512_bf16)")
    # into the kernel cache the engine builds into (keyed by sources, flags and CPU): the native
    # build is the engine's own and the AVX2 pass reuses this pass's builds (~12 s a compile)
    return kernels_at(KERNEL_BUILDS[request.param] or host_isa())


@pytest.fixture(scope="session")
def amx_lib(tmp_path_factory):
    """This host's kernels with the quantized linears on AMX tiles at every row count of
    bfloat16 x; skipped without AMX or a C compiler."""
    import ctypes

    from engine import kernels
    from engine.kernels.isa import host_isa

    compiler = kernels.find_compiler()
    if compiler is None or host_isa() != "amx":
        pytest.skip("needs an AMX host (amx_tile, amx_bf16, avx512_bf16) and a C compiler")
    # a copy of its own: one dlopen handle per path, and this one's row threshold (a C global)
    # is set to 1, which must not reach the engine's or `lib`'s native build
    path = kernels.build(compiler, kernels.BASE_CFLAGS + ["-march=native"],
                         tmp_path_factory.mktemp("amx"))
    built = kernels.CpuKernels(ctypes.CDLL(str(path)))
    assert built._fn["quant_amx_config"](1) == 0, "AMX tiles refused on an AMX host"
    built.amx_rows = 1
    return built


def pairs_build(request) -> bool:
    """Whether this test's `lib` build has AVX512-BF16, so that attention_amx.c takes prefill
    runs in bfloat16 pair products (tiles or vdpbf16ps): this host's own build or the
    avx512-no-amx one, on a CPU with avx512_bf16 — except where the engine's level is an Intel
    core's AVX512-BF16 without tiles (`slow_bf16_dot`: every build loaded here keeps the
    runs on the float32 loops)."""
    from engine.kernels.isa import cpu_flags, slow_bf16_dot

    return (request.node.callspec.params["lib"] in ("native", "avx512-no-amx")
            and "avx512_bf16" in cpu_flags() and not slow_bf16_dot())


def start_server(args: list[str], ready_path: str, log_path, timeout: float = 300,
                 new_session: bool = False, https_ca: str | None = None,
                 client_cert: tuple[str, str] | None = None, launcher: list[str] | None = None):
    """Start `python -m api serve ARGS --port P` (output to `log_path`; in a process group of
    its own with `new_session`, as a terminal's foreground job; `launcher` in place of
    `-m api`, e.g. a script that runs the module after changing the process) and wait until
    `ready_path`
    answers 200 (over HTTPS checked against the CA file `https_ca` when given, presenting
    `client_cert` (certificate, key) when given). Returns
    (process, base URL); raises RuntimeError with the log's tail if it exits or is not ready in
    `timeout` seconds."""
    import httpx

    port = free_port()
    if "--model-repository" in args and "--grpc-port" not in args:
        args = [*args, "--grpc-port", str(free_port())]     # never Triton's default 8001
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, *(launcher or ["-m", "api"]), "serve", "--port",
                             str(port), *args],
                            stdout=log, stderr=log, env=dict(os.environ),
                            start_new_session=new_session)
    base = f"{'https' if https_ca else 'http'}://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}{ready_path}", timeout=1,
                         verify=ssl_context(https_ca, client_cert)).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    with open(log_path, "rb") as f:
        raise RuntimeError(f"server not ready: {f.read().decode(errors='replace')[-3000:]}")


def ssl_context(ca: str | None, cert: tuple[str, str] | None = None):
    """httpx's `verify`: True, or an SSL context trusting the CA file `ca` and presenting
    `cert` (certificate, key files) when given."""
    if ca is None:
        return True
    import ssl
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def greedy(base: str, key: str | None = None, max_tokens: int = 8) -> str:
    """A greedy completion of a fixed prompt from the server at `base` (the check that a server
    still serves the same output after an ordeal). Fails the test on a non-200."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(base: str, name: str) -> float:
    """The first sample of metric `name` on `base`'s /metrics."""
    import re

    import httpx

    text = httpx.get(f"{base}/metrics", timeout=5).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def simple_repository(tmp_path) -> str:
    """A model repository under `tmp_path` holding only the example `simple` model; its path."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(root, "examples/model_repository/simple"), repo / "simple")
    return str(repo)


def stop_server(proc) -> None:
    """Terminate a server started by `start_server` and wait for it."""
    proc.terminate()
    proc.wait(30)


SESSION_GRPC: list[str] = []       # the session server's gRPC address
SESSION_LOG: list = []                     # the session server's log file


@pytest.fixture(scope="session")
def server_grpc(server) -> str:
    """The gRPC address ("host:port") of the session `server`."""
    return SESSION_GRPC[-1]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `python -m api serve` process on a free loopback port (one per session), serving
    the embedded LLM and the example Triton model repository on the same port."""
    from examples.prepare_model_repository import prepare

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prepare()                                   # the example model files (idempotent)
    SESSION_GRPC.append(f"127.0.0.1:{free_port()}")
    SESSION_LOG.append(tmp_path_factory.mktemp("server") / "server.log")
    proc, base = start_server(
        ["--api-key", KEY, "--model-repository", os.path.join(root, "examples/model_repository"),
         "--grpc-port", SESSION_GRPC[-1].rsplit(":", 1)[1],
         "--max-model-len", str(MAX_LEN), "--kv-cache-memory", "0.25", "--max-num-seqs", "4",
         "--max-waiting-requests", "2", "--uvicorn-log-level", "warning"], "/health/ready",
        SESSION_LOG[-1])
    yield base
    stop_server(proc)


@pytest.fixture(scope="session")
def v2_servers(tmp_path_factory):
    """{"main": (base URL, gRPC address), "locked": (...)}: two `--no-llm` servers over the same
    small repository (tests/triton_servers.py): `main` allows client shared memory and explicit
    model control, `locked` keeps client shared memory off and restricts the model-repository
    and statistics RPCs."""
    from tests.triton_servers import start_v2_servers
    from tests.v2_target import stop_v2_server
    addresses, servers = start_v2_servers(tmp_path_factory)
    yield addresses
    for server in servers:
        stop_v2_server(server)
