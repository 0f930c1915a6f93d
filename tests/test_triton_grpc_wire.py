"""ModelInfer request plans (triton_compat/frontend/grpc/wire.py): a request whose header was seen
before is decoded from its plan to exactly what parsing it and `codec.decode_request` give, and
every request a plan cannot stand for falls back to that parse. Requests are Triton's generated
messages serialized as a client serializes them; the live server's side (the same header with
new data and ids, a wrong-size entry after a planned header) is in test_triton_grpc.py."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from triton_compat.frontend.grpc.codec import decode_request
from triton_compat.frontend.grpc.wire import PLAN_CACHE_SIZE, Plans


def request(a, b, request_id="", model="simple", outputs=("OUTPUT0",), params=None,
            datatype="INT32") -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model, model_version="1", id=request_id)
    for name, x in (("INPUT0", a), ("INPUT1", b)):
        msg.inputs.add(name=name, datatype=datatype, shape=list(x.shape))
        msg.raw_input_contents.append(x.tobytes())
    for name in outputs:
        msg.outputs.add(name=name)
    for key, value in (params or {}).items():
        msg.parameters[key].int64_param = value
    return msg


def learned(plans: Plans, msg: pb.ModelInferRequest):
    """Teach `plans` the message as the service does after a full decode; the decoded request."""
    data = msg.SerializeToString()
    assert plans.decode(data) is None
    decoded = decode_request(pb.ModelInferRequest.FromString(data))
    plans.learn(data, pb.ModelInferRequest.FromString(data), decoded)
    return decoded


def same(planned, parsed) -> None:
    assert (planned.model, planned.version, planned.id) == (parsed.model, parsed.version,
                                                            parsed.id)
    assert planned.datatypes == parsed.datatypes and planned.parameters == parsed.parameters
    assert planned.outputs == parsed.outputs
    assert list(planned.inputs) == list(parsed.inputs)
    for name, array in parsed.inputs.items():
        got = planned.inputs[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        assert (got == array).all() and not got.flags.writeable


def test_a_seen_header_decodes_new_data_and_ids_as_the_parse_does():
    plans = Plans()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    learned(plans, request(a, a, "first", params={"priority": 2}))
    for k, request_id in enumerate(["", "second", "ünïcode-id", "x" * 300]):
        msg = request(a + k, a * k, request_id, params={"priority": 2})
        data = msg.SerializeToString()
        planned = plans.decode(data)
        assert planned is not None, request_id
        same(planned, decode_request(msg))
    # what a caller changes in one decoded request does not reach the next
    planned.parameters["priority"] = 9
    planned.outputs.append("OUTPUT1")
    planned.datatypes["INPUT0"] = "FP32"
    again = plans.decode(request(a, a, params={"priority": 2}).SerializeToString())
    same(again, decode_request(request(a, a, params={"priority": 2})))


def test_long_names_and_large_tensors_use_multi_byte_lengths():
    plans = Plans()
    big = np.arange(3 * 5000, dtype=np.float64).reshape(3, 5000)     # 120,000 bytes
    model = "m" * 200
    learned(plans, request(big, big, model=model, datatype="FP64"))
    msg = request(big + 1, big - 1, "id", model=model, datatype="FP64")
    planned = plans.decode(msg.SerializeToString())
    assert planned is not None
    same(planned, decode_request(msg))


def test_another_size_or_another_header_is_parsed():
    plans = Plans()
    a = np.zeros((1, 16), np.int32)
    learned(plans, request(a, a))
    shorter = request(a, a)
    shorter.raw_input_contents[1] = b"\0" * 60         # Triton's byte-size error, from the parse
    assert plans.decode(shorter.SerializeToString()) is None
    assert plans.decode(request(a, a, outputs=("OUTPUT1",)).SerializeToString()) is None
    assert plans.decode(request(a, a, model="other").SerializeToString()) is None
    batch = np.zeros((2, 16), np.int32)
    assert plans.decode(request(batch, batch).SerializeToString()) is None


@pytest.mark.parametrize("case", ["contents", "shared_memory", "bytes", "raw_first",
                                  "extra_raw", "unknown_field_last"])
def test_requests_a_plan_cannot_stand_for_are_never_planned(case):
    """Typed contents, a shared-memory input, a BYTES input, raw entries written before the
    inputs (not in field order), a raw entry no input uses, a field after the raw entries:
    each decoded by the parse every time."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    msg = request(a, a)
    data = None
    if case == "contents":
        del msg.raw_input_contents[:]
        for t in msg.inputs:
            t.contents.int_contents.extend(a.ravel().tolist())
    elif case == "shared_memory":
        del msg.raw_input_contents[1]
        msg.inputs[1].parameters["shared_memory_region"].string_param = "r"
        msg.inputs[1].parameters["shared_memory_byte_size"].int64_param = 64
    elif case == "bytes":
        msg = pb.ModelInferRequest(model_name="text")
        msg.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
        msg.raw_input_contents.append(b"\x05\0\0\0hello")
    elif case == "raw_first":
        raw_only = pb.ModelInferRequest(raw_input_contents=msg.raw_input_contents)
        del msg.raw_input_contents[:]
        data = raw_only.SerializeToString() + msg.SerializeToString()
    elif case == "extra_raw":
        msg.raw_input_contents.append(b"\0" * 64)
    elif case == "unknown_field_last":
        data = msg.SerializeToString() + b"\x48\x01"      # field 9, varint 1: kept unknown
    data = data or msg.SerializeToString()
    plans = Plans()
    parsed = pb.ModelInferRequest.FromString(data)
    try:
        decoded = decode_request(parsed)
    except Exception:                  # shared memory without the region: not decodable here
        decoded = None
    if decoded is not None:
        plans.learn(data, parsed, decoded)
    assert plans.plans == {} and plans.decode(data) is None


def test_garbage_and_truncated_bytes_fall_back_to_the_parse():
    plans = Plans()
    a = np.zeros((1, 16), np.int32)
    learned(plans, request(a, a))
    good = request(a, a, "abc").SerializeToString()
    bad_id = good.replace(b"\x1a\x03abc", b"\x1a\x03\xff\xfe\xfd")    # not UTF-8
    for data in (b"", b"\x1a", b"\x1a\xff\xff", good[:20], good[:-1], bad_id,
                 bytes(range(256)) * 3):
        assert plans.decode(data) is None


def test_the_cache_is_bounded():
    plans = Plans()
    for k in range(PLAN_CACHE_SIZE + 5):
        a = np.zeros((1, 16), np.int32)
        learned(plans, request(a, a, model=f"m{k}"))
    assert len(plans.plans) <= PLAN_CACHE_SIZE
    assert plans.decode(request(a, a, model=f"m{PLAN_CACHE_SIZE + 4}")
                        .SerializeToString()) is not None


@pytest.mark.parametrize("outputs", [
    [("OUTPUT0", "INT32", np.arange(16, dtype=np.int32).reshape(1, 16), False),
     ("OUTPUT1", "INT32", -np.arange(16, dtype=np.int32).reshape(1, 16), False)],
    [("big", "FP64", np.ones((3, 5000)), False),           # lengths past one varint byte
     ("scalar", "FP32", np.float32(2.5).reshape(()), False),  # no shape: field omitted
     ("empty", "INT64", np.zeros((0, 4), np.int64), False),   # an empty entry
     ("wide", "UINT8", np.zeros((0, 1 << 33), np.uint8), False)],  # a dimension past 2**32
    [("text", "BYTES", np.array([b"ab", "çé".encode(), b""], dtype=np.object_), False),
     ("in_region", "FP32", np.ones((2, 2), np.float32), True),    # written to shared memory
     ("", "BOOL", np.array([True, False]), False),                 # proto3: no name field
     ("ünï", "FP16", np.ones(3, np.float16), False)],
])
@pytest.mark.parametrize("model, version, request_id", [
    ("simple", "1", ""), ("", "", ""), ("m" * 300, "12", "ïd-" * 50)])
def test_responses_are_the_bytes_protobuf_writes(outputs, model, version, request_id):
    """`wire.encode_response` against upb's serializer of `codec.encode_response`'s message,
    byte for byte, twice (the second time from its caches)."""
    from triton_compat.frontend.grpc.codec import encode_response as message
    from triton_compat.frontend.grpc.wire import encode_response
    from triton_compat.frontend.infer import OutputRequest, OutputTensor, ShmRef
    tensors = [OutputTensor(name, datatype, array,
                            OutputRequest(name, shm=ShmRef("r", 0, 64) if shm else None))
               for name, datatype, array, shm in outputs]
    expected = message(model, version, request_id, tensors).SerializeToString()
    for _ in range(2):
        assert encode_response(model, version, request_id, tensors) == expected
    parsed = pb.ModelInferResponse.FromString(expected)
    assert [o.name for o in parsed.outputs] == [t.name for t in tensors]
