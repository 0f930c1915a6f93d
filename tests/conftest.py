"""Session fixtures: the embedded model (converted once into the cache) and its tokenizer.

The model cache is `$CONTINUUM_CACHE` (default `~/.cache/continuum`), shared with `make serve`,
so a machine converts the GGUF once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    """A real `python -m api serve` process on a free loopback port (one per session), serving
    the embedded LLM and the example Triton model repository on the same port."""
    import httpx

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "examples/prepare_model_repository.py")],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "api", "serve", "--port", str(port), "--api-key", KEY,
         "--model-repository", os.path.join(root, "examples/model_repository"),
         "--max-model-len", str(MAX_LEN), "--kv-cache-memory", "0.25", "--max-num-seqs", "4",
         "--max-waiting-requests", "2", "--uvicorn-log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not become ready")
    yield base
    proc.terminate()
    proc.wait(30)


