"""Triton's raw binary request (server/docs/protocol/extension_binary_data.md, "Raw Binary
Request"), against a live server: `POST .../infer` with `Inference-Header-Content-Length: 0`
and no JSON, the body being the data of the model's only input, whose name, datatype and shape
the server deduces from the config (batch 1 for a batching model, the one variable-sized
dimension from the body's size, a BYTES input only with shape [1]). The answer carries every
output as binary data. Also the refusals, with tritonserver 2.51's texts (what Triton's
qa/L0_http/http_test.py asserts). Runs against tritonserver 2.51 too
(`CONTINUUM_V2_TARGET=triton`).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.v2_target import start_v2_server, stop_v2_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name -> (max_batch_size, [(datatype, dims)] one per IN_<i> / OUT_<i>)
    "raw_fp32": (8, [("TYPE_FP32", "-1")]),
    "raw_fp32_fixed": (0, [("TYPE_FP32", "2, 4")]),
    "raw_bytes_one": (8, [("TYPE_STRING", "1")]),
    "raw_bytes_many": (8, [("TYPE_STRING", "-1")]),
    "raw_fp16_two_var": (8, [("TYPE_FP16", "-1, -1")]),
    "raw_three_inputs": (8, [("TYPE_FP32", "-1")] * 3),
}


def build_models(root: Path) -> None:
    """The echo model (OUT_<i> = IN_<i>) under each config of MODELS."""
    for name, (batch, ios) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/echo_model.py")
        inputs = ", ".join(f'{{ name: "IN_{i}" data_type: {t} dims: [ {d} ] }}'
                           for i, (t, d) in enumerate(ios))
        outputs = ", ".join(f'{{ name: "OUT_{i}" data_type: {t} dims: [ {d} ] }}'
                            for i, (t, d) in enumerate(ios))
        (root / name / "config.pbtxt").write_text(
            f'backend: "python"\nmax_batch_size: {batch}\ninput [ {inputs} ]\n'
            f"output [ {outputs} ]\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw_binary")
    build_models(root)
    s = start_v2_server(root, root / "server.log")
    yield s
    stop_v2_server(s)


def raw_infer(server, model: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.http}/v2/models/{model}/infer", content=body,
                      headers={"Inference-Header-Content-Length": "0"}, timeout=60)


def binary_output(response: httpx.Response) -> tuple[dict, bytes]:
    """The JSON header and the binary data after it."""
    size = int(response.headers["Inference-Header-Content-Length"])
    return json.loads(response.content[:size]), response.content[size:]


def test_raw_float_variable_dim_gets_batch_one(server):
    data = np.arange(8, dtype=np.float32).tobytes()
    r = raw_infer(server, "raw_fp32", data)
    assert r.status_code == 200, r.text
    header, binary = binary_output(r)
    out = header["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"]) == ("OUT_0", "FP32", [1, 8])
    assert out["parameters"]["binary_data_size"] == 32
    assert binary == data


def test_raw_float_fixed_shape_without_batching(server):
    data = np.arange(8, dtype=np.float32).tobytes()
    r = raw_infer(server, "raw_fp32_fixed", data)
    assert r.status_code == 200, r.text
    header, binary = binary_output(r)
    assert header["outputs"][0]["shape"] == [2, 4]
    assert binary == data


def test_raw_bytes_one_element(server):
    r = raw_infer(server, "raw_bytes_one", b"427")
    assert r.status_code == 200, r.text
    header, binary = binary_output(r)
    assert header["outputs"][0]["shape"] == [1, 1]
    assert binary == len(b"427").to_bytes(4, "little") + b"427"   # Triton's BYTES framing


@pytest.mark.parametrize("model, text", [
    ("raw_bytes_many", "For BYTE datatype raw input 'IN_0', the model must have input shape [1]"),
    ("raw_fp16_two_var", "The shape of the raw input 'IN_0' can not be deduced because there "
                         "are more than one variable-sized dimension"),
    ("raw_three_inputs", "Raw request must only have 1 input (found 1) to be deduced but got 3 "
                         "inputs in"),
])
def test_raw_request_refused_with_tritons_text(server, model, text):
    r = raw_infer(server, model, np.ones(4, dtype=np.float16).tobytes())
    assert r.status_code == 400
    assert text in r.json()["error"]
    assert httpx.get(f"{server.http}/v2/health/live").status_code == 200


def test_requests_repeating_one_binary_header_each_get_their_own_data(server):
    """A client sends the same JSON header before every request's binary data (tritonclient
    and perf_analyzer do): each answer carries its own request's data, and a body whose data
    no longer matches the header's `binary_data_size` is refused, before and after the
    same header was answered."""
    header = json.dumps({"inputs": [{"name": "IN_0", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUT_0",
                                      "parameters": {"binary_data": False}}]}).encode()

    def infer(data: bytes) -> httpx.Response:
        return httpx.post(f"{server.http}/v2/models/raw_fp32/infer", content=header + data,
                          headers={"Inference-Header-Content-Length": str(len(header))},
                          timeout=60)

    for step in range(3):
        values = np.arange(4, dtype=np.float32) + 10 * step
        r = infer(values.tobytes())
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == values.tolist()
    for data in (bytes(12), bytes(20)):       # 4 bytes short, 4 bytes over
        assert infer(data).status_code == 400
    r = infer(np.full(4, 7, dtype=np.float32).tobytes())
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [7.0] * 4
