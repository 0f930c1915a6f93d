"""The python backend's model API against a live server, through tritonclient: BLS (sync,
async, streaming from a decoupled model, errors as error responses, a call that could never run),
`async def execute` running a decoupled model's requests concurrently, DLPack with torch, each
model's own sibling modules, `auto_complete_config`, a non-decoupled model answering through
its response sender, the model loading API, and (slow) a python model calling the LLM. Every negative test ends with
a liveness check. Models: tests/triton_models/*.py.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import MODEL, free_port, start_server, stop_server
from tests.v2_target import (continuum_only, deviation, differs, start_v2_server, stop_v2_server,
                             wait_unloaded)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "triton_models"
INT16 = 'data_type: TYPE_INT32 dims: [ 16 ]'
CONFIGS = {
    "repeat": ('backend: "python" max_batch_size: 0 model_transaction_policy { decoupled: true } '
               'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ] '
               'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
               '{ name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]', "repeat_model.py"),
    "bls_sync": ('backend: "python" max_batch_size: 0 input [ '
                 '{ name: "MODE" data_type: TYPE_STRING dims: [ 1 ] }, '
                 f'{{ name: "INPUT0" {INT16} }}, {{ name: "INPUT1" {INT16} }}, '
                 '{ name: "INPUT_TEXT" data_type: TYPE_STRING dims: [ 1 ] optional: true } ] '
                 'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] }, '
                 '{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ -1 ] }, '
                 '{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, '
                 '{ name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] }, '
                 '{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]', "bls_model.py"),
    "bls_async": ('backend: "python" max_batch_size: 0 input [ '
                  f'{{ name: "INPUT0" {INT16} }}, {{ name: "INPUT1" {INT16} }} ] output [ '
                  f'{{ name: "OUTPUT0" {INT16} }}, {{ name: "OUTPUT1" {INT16} }}, '
                  '{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]',
                  "bls_async_model.py"),
    "async_pair": ('backend: "python" max_batch_size: 0 '
                   'model_transaction_policy { decoupled: true } input [ '
                   '{ name: "KEY" data_type: TYPE_STRING dims: [ 1 ] }, '
                   '{ name: "PARTNER" data_type: TYPE_STRING dims: [ 1 ] } ] '
                   'output [ { name: "IN_FLIGHT" data_type: TYPE_INT32 dims: [ 1 ] } ]',
                   "async_decoupled_model.py"),
    "dlpack": ('backend: "python" max_batch_size: 0 '
               'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ] output [ '
               '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
               '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] }, '
               '{ name: "HALF" data_type: TYPE_FP16 dims: [ -1 ] }, '
               '{ name: "ERRORS" data_type: TYPE_STRING dims: [ 2 ] }, '
               '{ name: "SHARED" data_type: TYPE_BOOL dims: [ 1 ] } ]', "dlpack_model.py"),
    "sender": ('backend: "python" max_batch_size: 0 '
               'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
               'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]', "sender_model.py"),
    "common_a": ('backend: "python" max_batch_size: 0 '
                 'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
                 'output [ { name: "VALUE" data_type: TYPE_STRING dims: [ 2 ] } ]',
                 "common_model.py"),
    "auto": (None, "auto_complete_model.py"),              # no config.pbtxt at all
    "auto_conflict": ('max_batch_size: 8', "auto_complete_model.py"),
}
CONFIGS["common_b"] = CONFIGS["common_a"]
LOADED_AT_START = [n for n in CONFIGS if n != "auto_conflict"] + ["simple"]


def build_repository(repo: Path) -> None:
    """The test models (model.py linked from tests/triton_models), `simple` from the examples,
    and a `model_common.py` / `model_lazy.py` of their own for common_a and common_b."""
    (repo / "simple").symlink_to(ROOT / "examples/model_repository/simple",
                                 target_is_directory=True)
    for name, (config, source) in CONFIGS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").symlink_to(MODELS / source)
        if config is not None:
            (repo / name / "config.pbtxt").write_text(config)
    for name in ("common_a", "common_b"):
        tag = name[-1]
        (repo / name / "1" / "model_common.py").write_text(f'VALUE = "{tag}-common"\n')
        (repo / name / "1" / "model_lazy.py").write_text(f'VALUE = "{tag}-lazy"\n')


def start(repo: Path, log: Path, llm: bool = False):
    """(process, HTTP address, gRPC address) of a server over `repo` (explicit model control,
    the models of LOADED_AT_START loaded); with the embedded LLM when `llm`."""
    grpc_port = free_port()
    models = [a for n in LOADED_AT_START for a in ("--load-model", n)]
    extra = ["--max-model-len", "512", "--kv-cache-memory", "0.25"] if llm else ["--no-llm"]
    proc, base = start_server([*extra, "--model-repository", str(repo), "--model-control-mode",
                               "explicit", *models, "--grpc-port", str(grpc_port),
                               "--uvicorn-log-level", "warning"], "/v2/health/ready", log,
                              timeout=600 if llm else 120)
    return proc, base.removeprefix("http://"), f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(HTTP client, gRPC address) of a server over the test repository: Continuum with
    `--no-llm`, or tritonserver 2.51 under CONTINUUM_V2_TARGET=triton (tests/v2_target.py)."""
    repo = tmp_path_factory.mktemp("repository")
    build_repository(repo)
    v2 = start_v2_server(repo, repo.parent / "server.log", control_mode="explicit",
                         load_models=LOADED_AT_START)
    client = httpclient.InferenceServerClient(v2.http.removeprefix("http://"),
                                              network_timeout=120)
    yield client, v2.grpc
    client.close()
    stop_v2_server(v2)


def tensor(name: str, array: np.ndarray, datatype: str):
    t = httpclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def bls_sync(client, mode: str, x: np.ndarray, y: np.ndarray, prompt: str | None = None):
    inputs = [tensor("MODE", np.array([mode.encode()], np.object_), "BYTES"),
              tensor("INPUT0", x, "INT32"), tensor("INPUT1", y, "INT32")]
    if prompt is not None:
        inputs.append(tensor("INPUT_TEXT", np.array([prompt.encode()], np.object_), "BYTES"))
    return client.infer("bls_sync", inputs)


def assert_live(client) -> None:
    """The server is live and still serves a BLS pipeline."""
    assert client.is_server_live() and client.is_server_ready()
    x = np.arange(16, dtype=np.int32)
    result = bls_sync(client, "simple", x, x)
    assert result.as_numpy("OUTPUT0").tolist() == (2 * x).tolist()


def success_count(client, model: str) -> int:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"])


def test_bls_calls_another_model_and_counts_there(server):
    client, _ = server
    x, y = np.arange(16, dtype=np.int32), np.full(16, 3, np.int32)
    before = success_count(client, "simple")
    result = bls_sync(client, "simple", x, y)
    assert result.as_numpy("OUTPUT0").tolist() == (x + y).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (x - y).tolist()
    assert result.as_numpy("ERROR")[0] == b""
    assert success_count(client, "simple") == before + 1   # `simple` ran it, as any request


def test_async_execute_awaits_async_exec_calls(server):
    client, _ = server
    x, y = np.arange(16, dtype=np.int32), np.full(16, 5, np.int32)
    result = client.infer("bls_async", [tensor("INPUT0", x, "INT32"),
                                        tensor("INPUT1", y, "INT32")])
    assert result.as_numpy("OUTPUT0").tolist() == (x + y).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (y - x).tolist()
    assert result.as_numpy("COUNT").tolist() == [4]       # 3 responses + the final flag


def test_bls_streams_a_decoupled_models_responses(server):
    client, _ = server
    x = np.array([9, 8, 7, 6] + [0] * 12, np.int32)
    result = bls_sync(client, "stream", x, x)
    assert result.as_numpy("ERROR")[0] == b""
    assert result.as_numpy("OUTPUT0").tolist() == [9, 8, 7, 6]
    assert result.as_numpy("COUNT").tolist() == [5]       # the flag-only final one included


@pytest.mark.parametrize("mode,words", [
    ("missing", "Failed for execute the inference request. Model 'no_such_model' is not "
                "ready."),
    ("bad_input", "expected 2 inputs but got 1 inputs for model 'simple'"),
    ("no_decoupled_flag", "Model repeat is using the decoupled. The current BLS request call "
                          "doesn't support models using the decoupled transaction policy."),
    pytest.param("self", "every instance of model 'bls_sync' (1) is waiting for a BLS "
                 "request to that model", marks=differs("bls-self-call")),
])
def test_bls_failures_are_error_responses(server, mode, words):
    client, _ = server
    x = np.zeros(16, np.int32)
    result = bls_sync(client, mode, x, x)
    assert words in result.as_numpy("ERROR")[0].decode()
    assert_live(client)


def test_an_exception_in_execute_is_the_requests_error_with_its_traceback(server):
    """A model whose `execute` raises fails its requests with the python backend's text: the
    instance's name, the exception as pybind11 prints it and the model's frames, innermost
    first; over HTTP a 500."""
    client, _ = server
    x = np.zeros(16, np.int32)
    with pytest.raises(InferenceServerException) as e:
        bls_sync(client, "raise", x, x)
    assert e.value.status() == "500"
    head, _, frames = e.value.message().partition("\n\nAt:\n")
    assert head == ("Failed to process the request(s) for model 'bls_sync_0', message: "
                    "ValueError: refused on purpose")
    lines = frames.splitlines()
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["refuse", "run", "execute"]
    assert all(line.startswith("  ") and "/bls_sync/1/model.py(" in line for line in lines)
    assert_live(client)


def test_async_execute_overlaps_a_decoupled_models_requests(server):
    """`a` waits until `b` has arrived and `b` until `a` has: on the model's one instance both
    finish only if `b`'s execution starts while `a`'s coroutine still waits."""
    _, grpc = server
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for key, partner in (("a", "b"), ("b", "a")):
            inputs = []
            for name, value in (("KEY", key), ("PARTNER", partner)):
                t = grpcclient.InferInput(name, [1], "BYTES")
                t.set_data_from_numpy(np.array([value.encode()], np.object_))
                inputs.append(t)
            client.async_stream_infer("async_pair", inputs, request_id=key)
        out = [got.get(timeout=90) for _ in range(2)]
    finally:
        client.stop_stream()
        client.close()
    assert [e for _, e in out] == [None, None]
    in_flight = sorted(int(r.as_numpy("IN_FLIGHT")[0]) for r, _ in out)
    assert in_flight == [1, 2]    # the second answered while the first's coroutine still ran


def test_dlpack_round_trip_with_torch(server):
    client, _ = server
    x = np.array([1.5, -2.0, 3.25], np.float32)
    result = client.infer("dlpack", [tensor("INPUT0", x, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == (x * 2).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (x + 1).tolist()
    half = result.as_numpy("HALF")
    assert half.dtype == np.float16 and half.tolist() == x.astype(np.float16).tolist()
    assert result.as_numpy("ERRORS").tolist() == [
        b"DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in "
        b"C-Order are supported.", b"DLPack does not have support for string tensors."]
    assert result.as_numpy("SHARED").tolist() == [deviation("dlpack-zero-copy", continuum=True,
                                                            triton=False)]


def test_each_model_imports_its_own_sibling_modules(server):
    client, _ = server
    one = [tensor("IN", np.array([1], np.int32), "INT32")]
    for name in ("common_a", "common_b", "common_a"):
        tag = name[-1]
        assert client.infer(name, one).as_numpy("VALUE").tolist() == [
            f"{tag}-common".encode(), f"{tag}-lazy".encode()]


def test_auto_complete_config_is_the_models_config(server):
    client, _ = server
    config = client.get_model_config("auto")
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("OUTPUT0", [4])]
    x = np.ones((2, 4), np.float32)
    result = client.infer("auto", [tensor("INPUT0", x, "FP32"), tensor("INPUT1", x, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == (2 * x).tolist()


def test_auto_complete_conflict_fails_the_load(server):
    client, _ = server
    with pytest.raises(InferenceServerException) as e:
        client.load_model("auto_conflict")
    assert "configuration specified max_batch_size 8, but in auto-complete-config function " \
           "for model 'auto_conflict' specified max_batch_size 4" in e.value.message()
    # a model whose version failed keeps the server not ready until it loads (Triton's strict
    # readiness; an unload does not clear it)
    assert client.is_server_live() and not client.is_server_ready()
    client.unload_model("auto_conflict")
    wait_unloaded(client, "auto_conflict")
    assert not client.is_server_ready()
    client.load_model("auto_conflict", config=json.dumps({"max_batch_size": 4}))
    assert client.is_model_ready("auto_conflict")
    assert_live(client)


def test_model_loading_api(server):
    """`is_model_ready` and `load_model` from a model: a load with a config override loads."""
    client, _ = server
    client.unload_model("auto_conflict")
    wait_unloaded(client, "auto_conflict")      # before the model's own load_model of it
    x = np.zeros(16, np.int32)
    result = bls_sync(client, "loading_ok", x, x)
    assert result.as_numpy("COUNT").tolist() == [1]        # simple ready, no_such_model not
    assert result.as_numpy("ERROR")[0].decode() == ""
    assert client.is_model_ready("auto_conflict")
    assert client.get_model_config("auto_conflict")["max_batch_size"] == 4
    assert_live(client)


# tritonserver 2.51's python backend aborts the whole server (boost::interprocess::lock_exception
# thrown in TRITONBACKEND_ModelInstanceExecute) in about half the runs where a model's
# load_model fails after the test above's sequence; the same crash family as
# triton-inference-server/server#8882. What is asserted is the python backend's documented API.
@continuum_only("a failing load_model from a model aborts tritonserver 2.51 intermittently")
def test_model_loading_api_failure(server):
    """A failed `load_model` from a model comes back as the model's exception, with the
    reason; the server keeps serving."""
    client, _ = server
    client.unload_model("auto_conflict")        # its config.pbtxt conflicts with the model
    wait_unloaded(client, "auto_conflict")
    x = np.zeros(16, np.int32)
    result = bls_sync(client, "loading", x, x)
    assert result.as_numpy("COUNT").tolist() == [1]
    assert "configuration specified max_batch_size 8" in result.as_numpy("ERROR")[0].decode()
    client.load_model("auto_conflict", config=json.dumps({"max_batch_size": 4}))   # ready again
    assert_live(client)


def test_model_not_decoupled_answers_through_its_sender(server):
    client, _ = server
    result = client.infer("sender", [tensor("IN", np.array([3], np.int32), "INT32")])
    assert result.as_numpy("OUT").tolist() == [30]


@pytest.mark.extended          # a server of its own: the stress tier (make test-stress)
@pytest.mark.slow
@continuum_only("the LLM (a python pipeline calling it through BLS)")
def test_bls_pipeline_calls_the_llm(tmp_path_factory):
    """A python model streaming from the served LLM through BLS (the LLM's generate runs on the
    server's event loop): the same greedy text as the LLM's own generate endpoint."""
    import httpx

    repo = tmp_path_factory.mktemp("llm_repository")
    build_repository(repo)
    proc, http, _ = start(repo, repo.parent / "server.log", llm=True)
    client = httpclient.InferenceServerClient(http, network_timeout=300)
    try:
        x = np.zeros(16, np.int32)
        result = bls_sync(client, f"llm:{MODEL}", x, x, prompt="The capital of France is")
        assert result.as_numpy("ERROR")[0] == b""
        assert result.as_numpy("COUNT")[0] >= 1
        body = {"text_input": "The capital of France is", "stream": False,
                "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})}
        direct = httpx.post(f"http://{http}/v2/models/{MODEL}/generate", json=body,
                            timeout=300).json()["text_output"]
        assert direct and result.as_numpy("TEXT")[0].decode() == direct
        assert_live(client)
    finally:
        client.close()
        stop_server(proc)
