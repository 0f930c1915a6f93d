"""Triton's extensions a user reaches for, against a live server in model control mode none,
over `tritonclient.http` and `tritonclient.grpc`: classification
(`InferRequestedOutput(name, class_count=k)`, as the `image_client` example asks: the top-k
classes as BYTES "<value>:<index>[:<label>]", batched and not, with labels from the output's
`label_filename`, floats with six decimals and integers as they are — tritonserver 2.51's
`std::to_string` — and the errors), the extension list, and the refusal of model control
requests without explicit mode, and logging (`/v2/logging`, gRPC `LogSettings`: Triton's
settings, texts and partial updates; the verbose level logging each request). Runs against tritonserver 2.51 too
(`CONTINUUM_V2_TARGET=triton`); every negative test ends with a liveness check.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.v2_target import continuum_only, deviation, differs, start_v2_server, \
    stop_v2_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
LABELS = ["cat", "dog", "", "fish", "bird", "horse"]       # index 2 has no label
IO = '''
input [ {{ name: "IN_F" data_type: TYPE_FP32 dims: [ 6 ] }},
        {{ name: "IN_I" data_type: TYPE_INT32 dims: [ 6 ] }},
        {{ name: "IN_S" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "OUT_F" data_type: TYPE_FP32 dims: [ 6 ] {label} }},
         {{ name: "OUT_I" data_type: TYPE_INT32 dims: [ 6 ] }},
         {{ name: "OUT_S" data_type: TYPE_STRING dims: [ 1 ] }} ]
'''
MODELS = {"classes": 4, "classes_flat": 0}     # name -> max_batch_size
SERVER_LOG: list[Path] = []                     # the module server's log file


def server_log(_server) -> str:
    """What the module's server has logged so far."""
    return SERVER_LOG[-1].read_text(errors="replace")


def build_models(root: Path) -> None:
    for name, batch in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/echo_model.py")
        (root / name / "labels.txt").write_text("".join(f"{x}\n" for x in LABELS))
        (root / name / "config.pbtxt").write_text(
            f'backend: "python"\nmax_batch_size: {batch}\n'
            + IO.format(label='label_filename: "labels.txt"'))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("classification")
    build_models(root)
    s = start_v2_server(root, root / "server.log")
    SERVER_LOG.append(root / "server.log")
    yield s
    stop_v2_server(s)


def expected(row: np.ndarray, k: int, labels: list[str] | None) -> list[bytes]:
    """The top-k strings written independently of the server: highest first."""
    order = sorted(range(row.size), key=lambda i: -float(row[i]))[:k]
    out = []
    for i in order:
        value = f"{row[i]:f}" if row.dtype.kind == "f" else str(int(row[i]))
        label = labels[i] if labels is not None and labels[i] else None
        out.append(f"{value}:{i}".encode() + (f":{label}".encode() if label else b""))
    return out


def as_bytes(row) -> list[bytes]:
    return [x if isinstance(x, bytes) else x.encode() for x in row]


def inputs(mod, scores: np.ndarray) -> list:
    f = mod.InferInput("IN_F", list(scores.shape), "FP32")
    f.set_data_from_numpy(scores.astype(np.float32))
    i = mod.InferInput("IN_I", list(scores.shape), "INT32")
    i.set_data_from_numpy((scores * 100).astype(np.int32))
    s = mod.InferInput("IN_S", list(scores.shape[:-1]) + [1], "BYTES")
    s.set_data_from_numpy(np.full(scores.shape[:-1] + (1,), b"x", dtype=np.object_))
    return [f, i, s]


SCORES = np.array([[0.25, 0.5, 2.0, -1.0, 0.125, 1.5],
                   [3.0, -2.0, 0.75, 1.25, 0.0, 0.5]], dtype=np.float32)


@pytest.mark.parametrize("protocol,binary", [("http", True), ("http", False), ("grpc", True)])
def test_batched_top_k_with_labels(server, protocol, binary):
    mod = httpclient if protocol == "http" else grpcclient
    client = (httpclient.InferenceServerClient(server.http.removeprefix("http://"))
              if protocol == "http" else grpcclient.InferenceServerClient(server.grpc))
    extra = {"binary_data": binary} if protocol == "http" else {}
    outs = [mod.InferRequestedOutput("OUT_F", class_count=3, **extra),
            mod.InferRequestedOutput("OUT_I", class_count=10, **extra),
            mod.InferRequestedOutput("OUT_S", **extra)]
    r = client.infer("classes", inputs(mod, SCORES), outputs=outs)
    f, i = r.as_numpy("OUT_F"), r.as_numpy("OUT_I")
    assert f.shape == (2, 3) and i.shape == (2, 6)         # k capped at the class count
    for b in range(2):         # (JSON BYTES come back as str from tritonclient.http)
        assert as_bytes(f[b]) == expected(SCORES[b], 3, LABELS)
        assert as_bytes(i[b]) == expected((SCORES[b] * 100).astype(np.int32), 6, None)
    out = r.get_output("OUT_F")
    assert (out["datatype"] if protocol == "http" else out.datatype) == "BYTES"
    assert r.as_numpy("OUT_S").shape == (2, 1)             # not asked: the tensor itself
    client.close()


def test_unbatched_model_classifies_the_whole_output(server):
    client = httpclient.InferenceServerClient(server.http.removeprefix("http://"))
    r = client.infer("classes_flat", inputs(httpclient, SCORES[0]), outputs=[
        httpclient.InferRequestedOutput("OUT_F", class_count=2)])
    assert list(r.as_numpy("OUT_F")) == [b"2.000000:2", b"1.500000:5:horse"]
    assert [o["name"] for o in r.get_response()["outputs"]] == ["OUT_F"]
    client.close()


def test_a_count_of_zero_returns_the_tensor(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    r = client.infer("classes", inputs(grpcclient, SCORES), outputs=[
        grpcclient.InferRequestedOutput("OUT_F", class_count=0)])
    np.testing.assert_array_equal(r.as_numpy("OUT_F"), SCORES)
    client.close()


@differs("classification-unsupported-type")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bytes_output_cannot_be_classified(server, protocol):
    mod = httpclient if protocol == "http" else grpcclient
    client = (httpclient.InferenceServerClient(server.http.removeprefix("http://"))
              if protocol == "http" else grpcclient.InferenceServerClient(server.grpc))
    with pytest.raises(InferenceServerException,
                       match="class result not available for output due to unsupported "
                             "type 'BYTES'"):
        client.infer("classes", inputs(mod, SCORES), outputs=[
            mod.InferRequestedOutput("OUT_S", class_count=1)])
    assert client.is_server_live()
    r = client.infer("classes", inputs(mod, SCORES), outputs=[
        mod.InferRequestedOutput("OUT_F", class_count=1)])
    assert list(r.as_numpy("OUT_F").reshape(-1)) == [b"2.000000:2", b"3.000000:0:cat"]
    client.close()


def test_the_extension_list_names_what_is_served(server):
    meta = httpx.get(f"{server.http}/v2").json()
    assert {"classification", "sequence", "model_repository", "statistics",
            "binary_tensor_data", "system_shared_memory"} <= set(meta["extensions"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_model_control_without_explicit_mode_is_unavailable(server, protocol):
    """tritonserver 2.51's refusal, text and status (UNAVAILABLE: HTTP 503)."""
    text = "explicit model load / unload is not allowed if polling is enabled"
    if protocol == "http":
        for action in ("load", "unload"):
            r = httpx.post(f"{server.http}/v2/repository/models/classes/{action}")
            assert (r.status_code, r.json()["error"]) == (503, text)
        assert httpx.get(f"{server.http}/v2/models/classes/ready").status_code == 200
    else:
        client = grpcclient.InferenceServerClient(server.grpc)
        with pytest.raises(InferenceServerException, match=text) as e:
            client.unload_model("classes")
        assert e.value.status() == "StatusCode.UNAVAILABLE"
        assert client.is_model_ready("classes")
        client.close()


# --- the rule itself, without a server (triton_compat/frontend/classification.py) --------------------
def test_ties_types_and_refusals_of_the_rule():
    from triton_compat.frontend.classification import class_count, classify
    from triton_compat.errors import InferError

    tied = np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)
    assert list(classify(tied, "FP32", 3, False, None)) == \
        [b"3.000000:1", b"3.000000:2", b"2.000000:3"]          # ties: lower index first
    big = np.array([[2**64 - 1, 5]], dtype=np.uint64)
    assert list(classify(big, "UINT64", 1, True, ["a", "b"])[0]) == [b"18446744073709551615:0:a"]
    assert classify(np.zeros((3, 0), np.float32), "FP32", 2, True, None).shape == (3, 0)
    for dtype in ("FP16", "BF16", "BOOL", "BYTES"):
        with pytest.raises(InferError, match=f"unsupported type '{dtype}'"):
            classify(np.zeros(2, np.float16), dtype, 1, False, None)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(InferError, match="Unable to parse 'classification'"):
            class_count(bad)


# --- logging extension ------------------------------------------------------------------------
DEFAULT_LOG = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
               "log_verbose_level": 0, "log_format": "default"}


def test_log_settings_over_http_and_grpc(server):
    base = f"{server.http}/v2/logging"
    assert httpx.get(base).json() == DEFAULT_LOG
    try:
        r = httpx.post(base, json={"log_warning": False, "log_verbose_level": 2,
                                   "log_format": "ISO8601", "log_info": None})
        assert r.status_code == 200
        assert r.json() == {**DEFAULT_LOG, "log_warning": False, "log_verbose_level": 2,
                            "log_format": "ISO8601"}
        client = grpcclient.InferenceServerClient(server.grpc)
        got = client.get_log_settings(as_json=True)["settings"]
        assert got["log_warning"] == {"bool_param": False}
        assert got["log_verbose_level"] == {"uint32_param": 2}
        client.update_log_settings({"log_warning": True, "log_verbose_level": 0,
                                    "log_format": "default"})
        assert httpx.get(base).json() == DEFAULT_LOG
        client.close()
    finally:
        httpx.post(base, json=DEFAULT_LOG | {"log_file": None})


@pytest.mark.parametrize("body,status,text", [
    ({"log_file": "elsewhere.log"}, 501,
     "log file location can not be updated through network protocol"),
    ({"log_format": "json"}, deviation("client-error-4xx", continuum=400, triton=503),
     "invalid argument for --log_format, got: json"),
    ({"log_info": "no"}, deviation("client-error-4xx", continuum=400, triton=500),
     "attempt to access JSON non-boolean as boolean"),
    ({"log_verbose_level": -1}, deviation("client-error-4xx", continuum=400, triton=500),
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
])
def test_bad_log_settings_are_refused_and_what_came_before_stays(server, body, status, text):
    base = f"{server.http}/v2/logging"
    try:
        r = httpx.post(base, json={"log_error": False, **body})
        assert (r.status_code, r.json()["error"]) == (status, text)
        # Triton's order: log_file, log_info, log_warning, log_error, log_verbose_level,
        # log_format; those before the bad one stay applied
        applied = next(iter(body)) in ("log_verbose_level", "log_format")
        assert httpx.get(base).json()["log_error"] is (not applied)
    finally:
        httpx.post(base, json={"log_error": True})
    assert httpx.get(base).json() == DEFAULT_LOG and httpx.get(f"{server.http}/v2/health/live")


def test_grpc_log_settings_errors(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="log file location can not be "
                       "updated through network protocol") as e:
        client.update_log_settings({"log_file": "x.log"})
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException,
                       match="invalid argument for log_format, got: json") as e:
        client.update_log_settings({"log_format": "json"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.get_log_settings(as_json=True)["settings"]["log_format"] == \
        {"string_param": "default"}
    assert client.is_server_live()
    client.close()


@continuum_only("the request line is Continuum's text")
def test_verbose_level_one_logs_each_request(server):
    client = httpclient.InferenceServerClient(server.http.removeprefix("http://"))
    try:
        httpx.post(f"{server.http}/v2/logging", json={"log_verbose_level": 1})
        client.infer("classes", inputs(httpclient, SCORES), request_id="logged-42")
        httpx.post(f"{server.http}/v2/logging", json={"log_verbose_level": 0})
        client.infer("classes", inputs(httpclient, SCORES), request_id="quiet-43")
    finally:
        httpx.post(f"{server.http}/v2/logging", json={"log_verbose_level": 0})
        client.close()
    text = server_log(server)
    assert "HTTP infer request: model 'classes' version '' id 'logged-42'" in text
    assert "quiet-43" not in text


@continuum_only("Continuum's flags: tritonserver's take the same values, its log lines differ")
def test_log_flags_at_start(tmp_path):
    import re
    import subprocess
    import sys

    root = tmp_path / "repo"
    build_models(root)
    log_file = tmp_path / "continuum.log"
    s = start_v2_server(root, tmp_path / "out.log", continuum_args=[
        "--log-file", str(log_file), "--log-format", "ISO8601", "--log-info", "false",
        "--log-verbose", "1"])
    try:
        assert httpx.get(f"{s.http}/v2/logging").json() == {
            **DEFAULT_LOG, "log_file": str(log_file), "log_info": False,
            "log_verbose_level": 1, "log_format": "ISO8601"}
        client = httpclient.InferenceServerClient(s.http.removeprefix("http://"))
        client.infer("classes", inputs(httpclient, SCORES), request_id="flagged-7")
        client.close()
    finally:
        stop_v2_server(s)
    lines = log_file.read_text().splitlines()
    # a verbose record is level I, as tritonserver writes it; the message a JSON string
    assert any(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ http_infer\.py:\d+\] "
                            r"\"HTTP infer request: model 'classes' version '' id 'flagged-7'\"",
                            x) for x in lines), lines[-5:]
    assert not [x for x in lines if "KServe v2" in x]              # --log-info false
    bad = subprocess.run([sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository",
                          str(root), "--log-info", "maybe"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == \
        "continuum: error: --log-info: expected true or false, got 'maybe'"


FORGED = "I0205 18:34:18.707423 1 file.cc:123] THIS ENTRY WAS INJECTED"   # L0_logging's
RECORD = r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] (?P<message>.*)"


@pytest.mark.parametrize("escaped", [True, False], ids=["escaped", "unescaped"])
def test_log_records_have_tritons_layout_and_request_text_cannot_forge_one(
        tmp_path, monkeypatch, escaped):
    """tritonserver's `default` layout on every record; a request's input name carrying a
    newline and a forged record stays inside a JSON-string message, unless
    TRITON_SERVER_ESCAPE_LOG_MESSAGES=0 (qa/L0_logging/log_format_test.py's injection test)."""
    import json
    import re

    if escaped:
        monkeypatch.delenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", raising=False)
    else:
        monkeypatch.setenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", "0")
    root = tmp_path / "repo"
    build_models(root)
    log_file = tmp_path / "server.log"
    flags = ["--log-file", str(log_file), "--log-verbose", "2147483647"]
    s = start_v2_server(root, tmp_path / "out.log", continuum_args=flags, triton_args=flags)
    try:
        client = httpclient.InferenceServerClient(s.http.removeprefix("http://"))
        bad = httpclient.InferInput(f"\n{FORGED}\n{FORGED}", [1, 6], "FP32")
        bad.set_data_from_numpy(SCORES[:1].astype(np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("classes", [bad])
        assert client.is_server_live()
        client.close()
    finally:
        stop_v2_server(s)
    lines = log_file.read_text().splitlines()
    assert (FORGED in lines) is not escaped
    assert any("HTTP request: 2 /v2/models/classes/infer" in line for line in lines)  # verbose
    assert re.fullmatch(RECORD, lines[0]), lines[0]
    if escaped:      # a record's first line; tritonserver follows some with a table or config
        for line in lines:
            match = re.fullmatch(RECORD, line)
            assert match or not line.startswith(("I", "W", "E")), line
            assert not (match and match["message"]) or \
                isinstance(json.loads(match["message"]), str), line     # empty: a table next
