"""Generated hostile input: schemathesis runs every route of the server's own `/openapi.json`
(OpenAI and v2, bodies included) against a real server process with well over 1,000 generated
cases, and finds no 5xx; afterwards the server is live, its greedy output unchanged, and its log
holds no traceback. A few minutes: marked `stress` (run by `make test-stress` and CI)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.conftest import KEY, greedy, simple_repository, start_server, stop_server

SEED = os.environ.get("CONTINUUM_FUZZ_SEED", "20261123")    # fixed: CI runs the same cases


@pytest.mark.stress
def test_schemathesis_finds_no_server_error(tmp_path):
    st = shutil.which("st", path=os.path.dirname(sys.executable))
    if st is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    repo = simple_repository(tmp_path)
    log = tmp_path / "server.log"
    # A short max_model_len keeps each generated request's generation short. Client shared
    # memory is on so that the shared-memory routes are fuzzed past Triton's 501 "disabled",
    # and model control explicit so that load / unload are fuzzed past tritonserver 2.51's
    # 503 refusal without it.
    proc, base = start_server(["--api-key", KEY, "--max-model-len", "64", "--kv-cache-memory",
                               "0.1", "--model-repository", repo, "--allow-client-shm",
                               "--model-control-mode", "explicit", "--load-model", "*",
                               "--uvicorn-log-level", "warning"], "/health/ready", log)
    try:
        before = greedy(base, KEY)
        run = subprocess.run(
            [st, "run", f"{base}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", "30", "--seed", SEED, "--request-timeout", "60",
             "-H", f"Authorization: Bearer {KEY}", "--no-color"],
            capture_output=True, text=True, timeout=1200, cwd=tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-5000:]
        generated = int(re.search(r"(\d+) generated", out).group(1))
        assert generated >= 1000, out[-2000:]
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert greedy(base, KEY) == before
    finally:
        stop_server(proc)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
