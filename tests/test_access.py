"""Access control against a real server process, through real clients: the API key (from the
`CONTINUUM_API_KEY` environment variable here) guards `/v1` — a wrong key is 401 and never
reaches the engine — and Triton's `--http-restricted-api` guards the chosen v2 categories with
403 in v2's shape, while unrestricted v2 routes, health and metrics stay open."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import MODEL, metric, simple_repository, start_server, stop_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "env-key"
ADMIN = {"admin-key": "s3cret"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("access")
    repo = simple_repository(tmp)
    mp = pytest.MonkeyPatch()
    mp.setenv("CONTINUUM_API_KEY", KEY)
    try:
        proc, base = start_server(
            ["--max-model-len", "256", "--kv-cache-memory", "0.05", "--model-repository",
             repo, "--model-control-mode", "explicit", "--load-model", "simple",
             "--http-restricted-api", "model-repository,statistics:admin-key=s3cret",
             "--uvicorn-log-level", "warning"], "/health/ready", tmp / "server.log")
    finally:
        mp.undo()
    yield base
    stop_server(proc)


def _prompt_tokens(base: str) -> float:
    return metric(base, "continuum_prompt_tokens_total")


def _complete(base: str, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3})


def test_api_key_from_the_environment_guards_v1(guarded):
    before = _prompt_tokens(guarded)
    for key in (None, "wrong"):
        r = _complete(guarded, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _prompt_tokens(guarded) == before, "a refused request reached the engine"
    assert _complete(guarded, KEY).status_code == 200
    assert _prompt_tokens(guarded) > before
    for path in ("/health", "/health/ready", "/metrics", "/version", "/v2/health/ready"):
        assert httpx.get(f"{guarded}{path}", timeout=5).status_code == 200


def test_restricted_v2_categories_need_the_header(guarded):
    client = httpclient.InferenceServerClient(guarded.removeprefix("http://"))
    for call in (lambda h: client.get_model_repository_index(headers=h),
                 lambda h: client.get_inference_statistics("simple", headers=h),
                 lambda h: client.unload_model("simple", headers=h)):
        with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
            call(None)
        with pytest.raises(InferenceServerException, match="restricted"):
            call({"admin-key": "wrong"})
    assert client.is_model_ready("simple")                 # the unload never happened
    # the repository's model, and the served LLM as a Triton model
    assert [m["name"] for m in client.get_model_repository_index(headers=ADMIN)] == [
        "SmolLM2-135M-Instruct", "simple"]
    assert client.get_inference_statistics("simple", headers=ADMIN)["model_stats"]
    r = httpx.post(f"{guarded}/v2/repository/index", timeout=5)
    assert r.status_code == 403 and "restricted" in r.json()["error"]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)       # inference is not restricted
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    out = client.infer("simple", inputs).as_numpy("OUTPUT0")
    assert (out == 2 * a).all()
    assert client.get_model_config("simple")["name"] == "simple"


# tritonserver 2.51's texts (qa L0_http/L0_grpc); a refusal takes ~0.2 s (no torch is loaded)
@pytest.mark.parametrize("option,flag,words", [
    ("--http-restricted-api", "bogus:k=v", "unknown restricted api 'bogus'"),
    ("--http-restricted-api", "inference", "expected <API>"),
    ("--http-restricted-api", "inference:k=v",
     "api 'inference' can not be specified in multiple config groups"),
    ("--grpc-restricted-protocol", "bogus:k=v",
     "unknown restricted protocol 'bogus'"),
    ("--grpc-restricted-protocol", "inference:k=v",
     "protocol 'inference' can not be specified in multiple config groups"),
])
def test_bad_restricted_api_flag_is_one_line(option, flag, words):
    args = [option, flag, option, "inference:x=y"]
    r = subprocess.run([sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository",
                        os.path.join(ROOT, "examples/model_repository"), *args,
                        "--port", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("continuum: error:")
    assert words in lines[0]
