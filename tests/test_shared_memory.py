"""Triton's shared-memory extension against a live server: regions created with
`tritonclient.utils.shared_memory` (POSIX objects), registered and used over gRPC and HTTP with
the official clients; inputs read from regions, outputs written into them; Triton's texts for
every refusal; deferred unregister while an inference uses a region. Every negative test ends
with a liveness check. CUDA regions are tested where CUDA is present, skipped elsewhere.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def clients(v2_servers):
    g = grpcclient.InferenceServerClient(v2_servers["main"][1])
    h = httpclient.InferenceServerClient(v2_servers["main"][0].removeprefix("http://"))
    yield g, h
    g.unregister_system_shared_memory()
    g.close()


@pytest.fixture
def region():
    """A fresh 256-byte POSIX shared-memory object: (handle, key); destroyed afterwards."""
    key = f"/continuum_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key.lstrip("/"), key, 256)
    yield handle, key
    shm.destroy_shared_memory_region(handle)


def alive(g) -> None:
    ins = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
           grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    ins[0].set_data_from_numpy(A)
    ins[1].set_data_from_numpy(B)
    assert (g.infer("simple", ins).as_numpy("OUTPUT0") == A + B).all()


def error_of(fn) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        fn()
    return info.value


def shm_io(mod, name, in_size=64, out_size=64):
    """simple's inputs at offsets 0 / 64 and outputs at 128 / 192 of region `name`."""
    ins = [mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")]
    ins[0].set_shared_memory(name, in_size)
    ins[1].set_shared_memory(name, 64, offset=64)
    outs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outs[0].set_shared_memory(name, out_size, offset=128)
    outs[1].set_shared_memory(name, 64, offset=192)
    return ins, outs


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_inputs_and_outputs_through_a_region(clients, region, protocol):
    g, h = clients
    handle, key = region
    name = key.lstrip("/")
    client, mod = (g, grpcclient) if protocol == "grpc" else (h, httpclient)
    client.register_system_shared_memory(name, key, 256)
    try:
        status = client.get_system_shared_memory_status(name)
        entry = (status.regions[name] if protocol == "grpc" else status[0])
        got = ((entry.key, entry.byte_size) if protocol == "grpc"
               else (entry["key"], entry["byte_size"]))
        assert got == (key, 256)
        for step in range(3):           # the region is reused: each request reads it afresh
            shm.set_shared_memory_region(handle, [A + step, B])
            ins, outs = shm_io(mod, name)
            result = client.infer("simple", ins, outputs=outs)
            assert (shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128)
                    == A + step + B).all()
            assert (shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=192)
                    == A + step - B).all()
            out = result.get_output("OUTPUT0")
            shape = list(out.shape) if protocol == "grpc" else out["shape"]
            assert shape == [1, 16]
            if protocol == "http":         # no data for an output in a region (as Triton)
                assert "data" not in out and "parameters" not in out
    finally:
        client.unregister_system_shared_memory(name)
    assert name not in [r["name"] for r in h.get_system_shared_memory_status()]
    alive(g)


def test_region_registered_over_http_is_used_over_grpc(clients, region):
    g, h = clients
    handle, key = region
    name = key.lstrip("/")
    h.register_system_shared_memory(name, key, 256)
    try:
        shm.set_shared_memory_region(handle, [A, B])
        ins, outs = shm_io(grpcclient, name)
        outs = outs[:1]
        result = g.infer("simple", ins, outputs=outs)
        assert result.get_response().raw_output_contents == [b""]   # its bytes are in the region
        assert (shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128) == A + B).all()
    finally:
        g.unregister_system_shared_memory(name)


def test_register_refusals_have_tritons_texts(clients, region):
    g, h = clients
    _, key = region
    name = key.lstrip("/")
    cases = [
        ("/", "cannot register shared memory region 'x' - invalid shm key '/'"),
        ("/../etc/passwd", "cannot register shared memory region 'x' - invalid shm key "
                           "'/../etc/passwd'"),
        ("/..", "cannot register shared memory region 'x' - invalid shm key '/..'"),
        ("/a/b", "cannot register shared memory region 'x' - invalid shm key '/a/b'"),
        ("/triton_python_backend_shm_region_1",
         "cannot register shared memory region 'x' with key "
         "'/triton_python_backend_shm_region_1' as the key contains the reserved prefix "
         "'triton_python_backend_shm_region_'"),
    ]
    for bad_key, text in cases:
        e = error_of(lambda: g.register_system_shared_memory("x", bad_key, 16))
        assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT", text)
        e = error_of(lambda: h.register_system_shared_memory("x", bad_key, 16))
        assert (e.status(), e.message()) == ("400", text)
    e = error_of(lambda: g.register_system_shared_memory("x", "/continuum_no_such", 16))
    assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT",
                                         "Unable to open shared memory region: "
                                         "'/continuum_no_such'")
    e = error_of(lambda: g.register_system_shared_memory("x", key, 200, offset=100))
    assert e.message() == "failed to register shared memory region 'x': invalid args"
    g.register_system_shared_memory(name, key, 256)
    try:
        e = error_of(lambda: g.register_system_shared_memory(name, key, 16))
        assert (e.status(), e.message()) == ("StatusCode.ALREADY_EXISTS",
                                             f"shared memory region '{name}' already in manager")
        e = error_of(lambda: h.register_system_shared_memory(name, key, 16))
        assert (e.status(), e.message()) == ("400",
                                             f"shared memory region '{name}' already in manager")
    finally:
        g.unregister_system_shared_memory(name)
    assert len(g.get_system_shared_memory_status().regions) == 0
    alive(g)


def test_status_and_unregister_rules(clients, region, v2_servers):
    g, h = clients
    _, key = region
    e = error_of(lambda: g.get_system_shared_memory_status("nosuch"))
    assert (e.status(), e.message()) == ("StatusCode.NOT_FOUND", "Unable to find system shared "
                                                                 "memory region: 'nosuch'")
    g.unregister_system_shared_memory("nosuch")           # unknown name: success
    for n in ("r1", "r2"):
        g.register_system_shared_memory(n, key, 128)
    assert sorted(g.get_system_shared_memory_status().regions) == ["r1", "r2"]
    h.unregister_system_shared_memory()                   # no name: all of them
    assert h.get_system_shared_memory_status() == []
    r = httpx.post(f"{v2_servers['main'][0]}/v2/systemsharedmemory/region/r/register",
                   json={"key": key})
    assert (r.status_code, r.json()) == (400, {"error": "Shared memory register request has "
                                                        "no 'byte_size' field"})
    r = httpx.post(f"{v2_servers['main'][0]}/v2/systemsharedmemory/register",
                   json={"key": key, "byte_size": 8})
    assert r.json() == {"error": "'region name' is necessary to register system shared "
                                 "memory region"}
    alive(g)


def test_inference_refusals_have_tritons_texts(clients, region):
    g, h = clients
    handle, key = region
    name = key.lstrip("/")
    g.register_system_shared_memory(name, key, 256)
    shm.set_shared_memory_region(handle, [A, B])
    try:
        ins, outs = shm_io(grpcclient, "nosuch")
        e = error_of(lambda: g.infer("simple", ins))
        assert (e.status(), e.message()) == ("StatusCode.NOT_FOUND",
                                             "Unable to find shared memory region: 'nosuch'")
        ins, outs = shm_io(grpcclient, name, in_size=60)
        e = error_of(lambda: g.infer("simple", ins))
        assert e.message() == ("[request id: <id_unknown>] input byte size mismatch for input "
                               "'INPUT0' for model 'simple'. Expected 64, got 60")
        ins, outs = shm_io(grpcclient, name, out_size=32)
        e = error_of(lambda: g.infer("simple", ins, outputs=outs))
        assert (e.status(), e.message()) == (
            "StatusCode.INVALID_ARGUMENT", "shared memory size specified with the request for output "
            "'OUTPUT0' (32 bytes) should be at least 64 bytes to hold the results")
        ins, _ = shm_io(grpcclient, name)
        ins[1].set_shared_memory(name, 64, offset=256)
        e = error_of(lambda: g.infer("simple", ins))
        assert e.message() == f"Invalid offset for shared memory region: '{name}'"
        ins[1].set_shared_memory(name, 64, offset=224)
        e = error_of(lambda: g.infer("simple", ins))
        assert e.message() == f"Invalid offset + byte size for shared memory region: '{name}'"
        hi, _ = shm_io(httpclient, name)
        hi[1].set_shared_memory(name, 2**64 - 1, offset=8)
        e = error_of(lambda: h.infer("simple", hi))
        assert e.message() == (f"Integer overflow detected: byte_size ({2**64 - 1}) + offset "
                               f"(8) exceeds maximum value ({2**64 - 1}) for region '{name}'")
    finally:
        g.unregister_system_shared_memory(name)
    alive(g)


def test_unregister_waits_for_the_inference_using_the_region(clients, region):
    """A region unregistered while a 300 ms inference reads it stays listed (its name taken)
    until that inference is done, which succeeds; then it is gone."""
    g, _ = clients
    handle, key = region
    name = key.lstrip("/")
    g.register_system_shared_memory(name, key, 256)
    shm.set_shared_memory_region(handle, [np.array([[41]], np.int32)])
    x = grpcclient.InferInput("IN", [1, 1], "INT32")
    x.set_shared_memory(name, 4)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=g.infer("delayed", [x])))
    worker.start()
    time.sleep(0.15)                          # the request now waits in the batcher / runs
    g.unregister_system_shared_memory(name)
    listed = list(g.get_system_shared_memory_status().regions)
    worker.join(30)
    assert listed == [name]
    assert int(result["r"].as_numpy("OUT")[0, 0]) == 41
    assert list(g.get_system_shared_memory_status().regions) == []
    alive(g)


def test_client_shared_memory_is_off_by_default(v2_servers):
    h = httpclient.InferenceServerClient(v2_servers["locked"][0].removeprefix("http://"))
    text = ("Client shared memory is disabled. Start the server with "
            "'--allow-client-shm=true' to enable.")
    for call in (lambda: h.register_system_shared_memory("r", "/k", 8),
                 lambda: h.unregister_system_shared_memory("r")):
        e = error_of(call)
        assert (e.status(), e.message()) == ("501", text)
    assert h.get_system_shared_memory_status() == []


def test_cuda_shared_memory_without_cuda_is_refused(clients):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: the register path is tested by "
                    "test_cuda_shared_memory_round_trip")
    g, h = clients
    e = error_of(lambda: g.register_cuda_shared_memory("c", b"\0" * 64, 0, 64))
    assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT",
                                         "failed to register CUDA shared memory region: 'c', "
                                         "GPUs not supported")
    e = error_of(lambda: h.register_cuda_shared_memory("c", b"\0" * 64, 0, 64))
    assert (e.status(), e.message()) == ("400", "failed to register CUDA shared memory region: "
                                                "'c', GPUs not supported")
    assert h.get_cuda_shared_memory_status() == []
    e = error_of(lambda: g.get_cuda_shared_memory_status("c"))
    assert e.message() == "Unable to find cuda shared memory region: 'c'"
    alive(g)


def test_cuda_shared_memory_round_trip(clients):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none on this host)")
    import tritonclient.utils.cuda_shared_memory as cudashm
    g, _ = clients
    handle = cudashm.create_shared_memory_region("cuda_in", 256, 0)
    try:
        cudashm.set_shared_memory_region(handle, [A, B])
        g.register_cuda_shared_memory("cuda_in", cudashm.get_raw_handle(handle), 0, 256)
        ins, outs = shm_io(grpcclient, "cuda_in")
        g.infer("simple", ins, outputs=outs)
        assert (cudashm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128)
                == A + B).all()
        g.unregister_cuda_shared_memory("cuda_in")
    finally:
        cudashm.destroy_shared_memory_region(handle)
