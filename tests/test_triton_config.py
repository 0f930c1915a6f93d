"""config.pbtxt loading (Triton's protobuf schema), version policies, and the v2 tensor codec."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from triton_compat.config import (ConfigError, batcher_config, config_to_json, load_config,
                                  select_versions)
from triton_compat.tensors import TensorError, encode_response, parse_request

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
    payload, n = encode_response("m", "1", "7", [("O", "FP32", np.ones(2, np.float32), True),
                                                 ("P", "BYTES", strs, False)])
    head = json.loads(payload[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert head["outputs"][1]["data"] == ["a", "\u00e9"]
    assert np.array_equal(np.frombuffer(payload[n:], np.float32), np.ones(2))


@pytest.mark.parametrize("body,message", [
    (b"{not json", "failed to parse the request JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "failed to parse the request JSON"),
    (b'{"inputs": [{"name": "I", "datatype": "INT33", "shape": [1], "data": [1]}]}',
     "invalid datatype"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [2], "data": [1]}]}',
     "1 elements in 'data' for shape"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1099511627776, 1099511627776],'
     b' "data": [1]}]}', "more than the"),
    (b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": ["x"]}]}',
     "not INT32"),
    (b'{"inputs": [{"name": "I", "datatype": "INT8", "shape": [1], "data": [300]}]}', "I"),
])
def test_malformed_requests_are_tensor_errors(body, message):
    with pytest.raises(TensorError, match=message):
        parse_request(body, None)
