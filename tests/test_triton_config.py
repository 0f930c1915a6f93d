"""config.pbtxt loading (Triton's protobuf schema), version policies, and the v2 tensor codec."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from triton_compat.core.config import ConfigError, batcher_config, config_to_json, select_versions
from triton_compat.core.config_loader import load_config
from triton_compat.frontend.infer import OutputRequest, OutputTensor
from triton_compat.frontend.tensors import TensorError, encode_response, parse_request

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "model_repository"


def model(tmp_path, text, versions=(1,), name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.pbtxt").write_text(text)
    for v in versions:
        (d / str(v)).mkdir()
    return d


def test_every_example_config_loads_with_its_defaults():
    for d in sorted(EXAMPLES.iterdir()):
        if d.is_dir():
            config = load_config(d)
            assert config.name == d.name
            assert select_versions(config, d) == [1]
    simple = load_config(EXAMPLES / "simple")
    as_json = config_to_json(simple)
    assert as_json["input"][0]["dims"] == [16]          # a number, not protobuf's "16"
    assert as_json["version_policy"] == {"latest": {"num_versions": 1}}
    assert as_json["instance_group"][0]["count"] == 1


def test_unknown_field_and_wrong_type_name_file_and_field(tmp_path):
    d = model(tmp_path, 'backend: "python"\nmax_batch_sise: 4\n')
    with pytest.raises(ConfigError, match=r"m/config.pbtxt: 2:1 .*no field named "
                                          r"\"max_batch_sise\""):
        load_config(d)
    d2 = model(tmp_path, 'backend: "python"\nmax_batch_size: "four"\n', name="m2")
    with pytest.raises(ConfigError, match=r"m2/config.pbtxt: .*max_batch_size.*integer"):
        load_config(d2)


def test_semantic_errors_name_the_field(tmp_path):
    d = model(tmp_path, 'backend: "tensorflow"')
    with pytest.raises(ConfigError, match="field 'backend': unsupported backend 'tensorflow'"):
        load_config(d)
    d2 = model(tmp_path, 'backend: "python" max_batch_size: 4 '
                         'dynamic_batching { preferred_batch_size: [8] }', name="m2")
    with pytest.raises(ConfigError, match="field 'preferred_batch_size' must be in 1..max"):
        load_config(d2)
    d3 = model(tmp_path, 'name: "other" backend: "python"', name="m3")
    with pytest.raises(ConfigError, match="does not match its directory 'm3'"):
        load_config(d3)


def test_version_policies(tmp_path):
    d = model(tmp_path, 'backend: "python"', versions=(1, 2, 3))
    assert select_versions(load_config(d), d) == [3]
    d2 = model(tmp_path, 'backend: "python" version_policy { latest { num_versions: 2 } }',
               versions=(1, 2, 3), name="m2")
    assert select_versions(load_config(d2), d2) == [2, 3]
    d3 = model(tmp_path, 'backend: "python" version_policy { all { } }', versions=(1, 3),
               name="m3")
    assert select_versions(load_config(d3), d3) == [1, 3]
    d4 = model(tmp_path, 'backend: "python" version_policy { specific { versions: [1, 4] } }',
               versions=(1, 2), name="m4")
    with pytest.raises(ConfigError, match="version 4 named by version_policy.specific"):
        select_versions(load_config(d4), d4)


def test_batcher_config_from_dynamic_batching(tmp_path):
    d = model(tmp_path, '''backend: "python" max_batch_size: 8
        dynamic_batching { preferred_batch_size: [4, 2] max_queue_delay_microseconds: 100
          priority_levels: 2 default_priority_level: 2
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 7 }
          priority_queue_policy { key: 1 value { max_queue_size: 3 } } }''')
    cfg = batcher_config(load_config(d))
    assert cfg.dynamic and cfg.preferred_batch_sizes == (2, 4) and cfg.max_queue_delay_us == 100
    assert cfg.policy(2).timeout_action == "DELAY" and cfg.policy(2).default_timeout_us == 7
    assert cfg.policy(1).max_queue_size == 3


def test_request_codec_json_and_binary_round_trip():
    ints = np.arange(6, dtype=np.int32).reshape(2, 3)
    strs = np.array([b"a", "\u00e9".encode()], dtype=object)
    header = {"id": "7", "inputs": [
        {"name": "I", "datatype": "INT32", "shape": [2, 3], "data": [[0, 1, 2], [3, 4, 5]]},
        {"name": "S", "datatype": "BYTES", "shape": [2],
         "parameters": {"binary_data_size": 11}}],
        "outputs": [{"name": "O", "parameters": {"binary_data": True}}]}
    raw = json.dumps(header).encode()
    body = raw + b"\x01\x00\x00\x00a\x02\x00\x00\x00\xc3\xa9"
    parsed = parse_request(body, len(raw))
    assert np.array_equal(parsed.inputs["I"], ints) and list(parsed.inputs["S"]) == list(strs)
    assert parsed.outputs[0].binary and parsed.id == "7"
    payload, n = encode_response("m", "1", "7", [
        OutputTensor("O", "FP32", np.ones(2, np.float32), OutputRequest("O", True)),
        OutputTensor("P", "BYTES", strs, OutputRequest("P", False))])
    head = json.loads(payload[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert head["outputs"][1]["data"] == ["a", "\u00e9"]
    assert np.array_equal(np.frombuffer(payload[n:], np.float32), np.ones(2))


@pytest.mark.parametrize("body,message", [
    (b"{not json", "failed to parse the request JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "non-existing object member 'inputs'"),
    (b'{"inputs": [{"name": "I", "datatype": "INT33", "shape": [1], "data": [1]}]}',
     "invalid datatype"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [2], "data": [1]}]}',
     "Shape does not match true shape of 'data' field"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1099511627776, 1099511627776],'
     b' "data": [1]}]}', "more than the"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": ["x"]}]}',
     "attempt to access JSON non-signed-integer as signed-integer"),
    (b'{"inputs": [{"name": "I", "datatype": "UINT32", "shape": [1], "data": [-1]}]}',
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    (b'{"inputs": [{"name": "I", "datatype": "INT8", "shape": [1], "data": [300]}]}', "I"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [2], "data": [1, true]}]}',
     "non-signed-integer as signed-integer"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [2], "data": [[1], [2.5]]}]}',
     "non-signed-integer as signed-integer"),
    (b'{"inputs": [{"name": "I", "datatype": "BOOL", "shape": [2], "data": [true, 0]}]}',
     "attempt to access JSON non-boolean as boolean"),
    (b'{"inputs": [{"name": "I", "datatype": "BYTES", "shape": [1], "data": [3]}]}',
     "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
])
def test_malformed_requests_are_tensor_errors(body, message):
    with pytest.raises(TensorError, match=message):
        parse_request(body, None)


DATATYPES = {"BOOL": np.array([[True, False, True]]), "UINT8": np.array([[0, 7, 255]], np.uint8),
             "UINT16": np.array([[0, 7, 65535]], np.uint16),
             "UINT32": np.array([[0, 7, 2**32 - 1]], np.uint32),
             "UINT64": np.array([[0, 7, 2**64 - 1]], np.uint64),
             "INT8": np.array([[-128, 0, 127]], np.int8),
             "INT16": np.array([[-32768, 0, 32767]], np.int16),
             "INT32": np.array([[-2**31, 0, 2**31 - 1]], np.int32),
             "INT64": np.array([[-2**63, 0, 2**63 - 1]], np.int64),
             "FP16": np.array([[-1.5, 0.0, 65504.0]], np.float16),
             "FP32": np.array([[-1.5, 0.25, 3.4e38]], np.float32),
             "FP64": np.array([[-1.5, 0.25, 1e300]], np.float64),
             "BYTES": np.array([[b"a", b"", "\u00e9\u6f22".encode()]], dtype=object)}


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("datatype", [*DATATYPES, "BF16"])
def test_every_datatype_round_trips_with_the_official_client_codec(datatype, binary):
    """tritonclient encodes the request, we decode it; we encode the response, it decodes it."""
    import ml_dtypes
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request

    array = (np.array([[-1.5, 0.0, 2.0]], dtype=ml_dtypes.bfloat16) if datatype == "BF16"
             else DATATYPES[datatype])
    if datatype == "BF16" and not binary:     # tritonclient sends BF16 only as binary data
        body, json_size = json.dumps({"inputs": [{"name": "X", "datatype": "BF16", "shape": [1, 3],
                                                  "data": [-1.5, 0.0, 2.0]}]}).encode(), None
    else:
        tensor = httpclient.InferInput("X", list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        body, json_size = _get_inference_request([tensor], "", None, 0, False, False, 0, None,
                                                 None)
    parsed = parse_request(body, json_size)
    got = parsed.inputs["X"]
    assert parsed.datatypes["X"] == datatype and got.shape == array.shape
    assert got.tolist() == array.tolist()
    payload, n = encode_response("m", "1", "", [OutputTensor("Y", datatype, got, None)],
                                 binary_default=binary)
    result = httpclient.InferResult.from_response_body(payload, header_length=n)
    back = result.as_numpy("Y")
    if datatype == "BYTES" and not binary:      # JSON BYTES come back as str
        back = np.array([[x.encode() if isinstance(x, str) else x for x in back[0]]],
                        dtype=object)
    assert back.tolist() == array.tolist()


@pytest.mark.parametrize("datatype", ["FP32", "FP16"])
def test_non_finite_floats_round_trip_in_json_as_tritonclient_writes_them(datatype):
    """tritonclient writes NaN / Infinity as JSON literals (Python's json); they are read, and
    an output holding them is written the same way, so the client reads them back."""
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request

    array = np.array([[np.nan, np.inf, -np.inf, 1.5]], np.float16 if datatype == "FP16"
                     else np.float32)
    tensor = httpclient.InferInput("X", [1, 4], datatype)
    tensor.set_data_from_numpy(array, binary_data=False)
    body, _ = _get_inference_request([tensor], "", None, 0, False, False, 0, None, None)
    got = parse_request(body, None).inputs["X"]
    assert np.array_equal(got, array, equal_nan=True)
    payload, n = encode_response("m", "1", "", [OutputTensor("Y", datatype, got, None)])
    back = httpclient.InferResult.from_response_body(payload, header_length=n).as_numpy("Y")
    assert np.array_equal(back, array, equal_nan=True)


def test_a_bf16_nan_output_is_written_as_nan_not_null():
    import ml_dtypes
    array = np.array([np.nan, 1.0], dtype=ml_dtypes.bfloat16)
    payload, _ = encode_response("m", "1", "", [OutputTensor("Y", "BF16", array, None)])
    assert b'"data":[NaN,1.0]' in payload
