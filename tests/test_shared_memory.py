"""Triton's shared-memory extension against a live server: regions created with
`tritonclient.utils.shared_memory` (POSIX objects), registered and used over gRPC and HTTP with
the official clients; inputs read from regions, outputs written into them; tritonserver 2.51's
texts for every refusal (its 500s for a client's mistake are 400s here); a region in use
cannot be unregistered. Every negative test ends with a liveness check. CUDA regions are
tested where CUDA is present, skipped elsewhere. Runs against tritonserver 2.51 too
(tests/v2_target.py).
"""

from __future__ import annotations

import base64
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

from tests.v2_target import continuum_only, deviation

pytestmark = pytest.mark.slow
# a client's mistake Triton 2.51 answers with 500 / INTERNAL
GRPC_MISTAKE = deviation("client-error-4xx", continuum="StatusCode.INVALID_ARGUMENT",
                         triton="StatusCode.INTERNAL")
HTTP_MISTAKE = deviation("client-error-4xx", continuum="400", triton="500")
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def clients(v2_servers):
    g = grpcclient.InferenceServerClient(v2_servers["main"][1])
    h = httpclient.InferenceServerClient(v2_servers["main"][0].removeprefix("http://"))
    yield g, h
    unregister(g)
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


def unregister(client, name: str = "", cuda: bool = False) -> None:
    """Unregister `name` (every region when empty) once the server has let go of it.
    tritonserver 2.51's gRPC frontend drops an inference's hold on its regions when the call's
    state is freed, which can come after the client has the response; an unregister sent at
    once is then refused as "currently in use" for a few milliseconds. Continuum lets go before
    it answers, so the first try succeeds there. Retries for up to 5 s, then raises."""
    call = client.unregister_cuda_shared_memory if cuda else client.unregister_system_shared_memory
    deadline = time.monotonic() + 5
    while True:
        try:
            return call(name)
        except InferenceServerException as e:
            busy = "in use" in e.message() or "Failed to unregister" in e.message()
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


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
        unregister(client, name)
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
        unregister(g, name)


def test_register_refusals_have_tritons_texts(clients, region):
    g, h = clients
    _, key = region
    name = key.lstrip("/")
    # keys that name nothing shm_open can open (never looked up outside /dev/shm here)
    for bad_key in ("/", "/../etc/passwd", "/..", "/a/b", "/triton_python_backend_shm_region_1",
                    "/continuum_no_such"):
        text = f"Unable to open shared memory region: '{bad_key}'"
        e = error_of(lambda: g.register_system_shared_memory("x", bad_key, 16))
        assert (e.status(), e.message()) == (GRPC_MISTAKE, text)
        e = error_of(lambda: h.register_system_shared_memory("x", bad_key, 16))
        assert (e.status(), e.message()) == (HTTP_MISTAKE, text)
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


@pytest.fixture
def region2(region):
    """A second region (another POSIX object) beside `region`."""
    key = f"/continuum_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key.lstrip("/"), key, 256)
    yield handle, key
    shm.destroy_shared_memory_region(handle)


def test_status_and_unregister_rules(clients, region, region2, v2_servers):
    g, h = clients
    e = error_of(lambda: g.get_system_shared_memory_status("nosuch"))
    assert (e.status(), e.message()) == ("StatusCode.NOT_FOUND", "Unable to find system shared "
                                                                 "memory region: 'nosuch'")
    g.unregister_system_shared_memory("nosuch")           # unknown name: success
    key = region[1]
    for n, (_, k) in (("r1", region), ("r2", region2)):
        g.register_system_shared_memory(n, k, 128)
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


def test_two_regions_on_one_key(clients, region):
    """Two regions over one POSIX object (say, inputs and outputs): both register and serve;
    tritonserver 2.51 refuses the second (docs/triton-conformance.md, shm-same-key)."""
    g, _ = clients
    handle, key = region
    g.register_system_shared_memory("ins", key, 128)
    try:
        def second():
            return g.register_system_shared_memory("outs", key, 128, offset=128)

        if deviation("shm-same-key", continuum=True, triton=False):
            second()
            ins, _ = shm_io(grpcclient, "ins")
            outs = [grpcclient.InferRequestedOutput("OUTPUT0"),
                    grpcclient.InferRequestedOutput("OUTPUT1")]
            outs[0].set_shared_memory("outs", 64)
            outs[1].set_shared_memory("outs", 64, offset=64)
            shm.set_shared_memory_region(handle, [A, B])
            g.infer("simple", ins, outputs=outs)
            assert (shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128)
                    == A + B).all()
        else:
            e = error_of(second)
            assert (e.status(), e.message()) == ("StatusCode.INTERNAL",
                                                 f"Invalid shared memory region: '{key}'")
    finally:
        unregister(g)
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
            GRPC_MISTAKE, "shared memory size specified with the request for output "
            "'OUTPUT0' (32 bytes) should be at least 64 bytes to hold the results")
        ins, _ = shm_io(grpcclient, name)
        ins[1].set_shared_memory(name, 64, offset=256)
        e = error_of(lambda: g.infer("simple", ins))
        assert e.message() == f"Invalid offset for shared memory region: '{name}'"
        ins[1].set_shared_memory(name, 64, offset=224)
        e = error_of(lambda: g.infer("simple", ins))
        assert e.message() == f"Invalid offset + byte size for shared memory region: '{name}'"
        hi, _ = shm_io(httpclient, name)        # offset + byte_size wraps past 2**64
        hi[1].set_shared_memory(name, 2**64 - 1, offset=8)
        e = error_of(lambda: h.infer("simple", hi))
        assert e.message() == ("[request id: <id_unknown>] input byte size mismatch for input "
                               f"'INPUT1' for model 'simple'. Expected 64, got {2**64 - 1}")
    finally:
        unregister(g, name)
    alive(g)


def test_a_region_in_use_cannot_be_unregistered(clients, region):
    """A region an inference is reading (IN 3000: the model sleeps 2.3 s) cannot be
    unregistered meanwhile, alone or with the others (tritonserver 2.51's texts); the inference
    succeeds, and afterwards the region unregisters."""
    g, h = clients
    handle, key = region
    name = key.lstrip("/")
    g.register_system_shared_memory(name, key, 256)
    shm.set_shared_memory_region(handle, [np.array([[3000]], np.int32)])
    x = grpcclient.InferInput("IN", [1, 1], "INT32")
    x.set_shared_memory(name, 4)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=g.infer("delayed", [x])))
    worker.start()
    try:
        time.sleep(0.5)                       # the request holds the region from here on
        e = error_of(lambda: g.unregister_system_shared_memory(name))
        assert (e.status(), e.message()) == (GRPC_MISTAKE, (
            f"Cannot unregister shared memory region '{name}', it is currently in use."))
        e = error_of(lambda: h.unregister_system_shared_memory())
        assert (e.status(), e.message()) == (HTTP_MISTAKE, (
            f"Failed to unregister the following system shared memory regions: {name} ,"))
        assert list(g.get_system_shared_memory_status().regions) == [name]
    finally:
        worker.join(30)
    assert int(result["r"].as_numpy("OUT")[0, 0]) == 3000
    unregister(g, name)
    assert list(g.get_system_shared_memory_status().regions) == []
    alive(g)


@continuum_only("--allow-client-shm is newer than tritonserver 2.51 (always on there)")
def test_client_shared_memory_is_off_by_default(v2_servers):
    """Off, client shared memory is refused as Triton refuses a restricted API: 403 with the
    text of later Tritons (which answer 501, a server fault to load balancers and fuzzers;
    deviation "client-shm-off")."""
    h = httpclient.InferenceServerClient(v2_servers["locked"][0].removeprefix("http://"))
    text = ("Client shared memory is disabled. Start the server with "
            "'--allow-client-shm=true' to enable.")
    for call in (lambda: h.register_system_shared_memory("r", "/k", 8),
                 lambda: h.unregister_system_shared_memory("r")):
        e = error_of(call)
        assert (e.status(), e.message()) == ("403", text)
    assert h.get_system_shared_memory_status() == []
    assert h.is_server_live()


def test_cuda_shared_memory_without_cuda_is_refused(clients):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: the register path is tested by "
                    "test_cuda_shared_memory_round_trip")
    g, h = clients
    # tritonserver 2.51 on a host without a GPU: the handle cannot be opened
    e = error_of(lambda: g.register_cuda_shared_memory("c", b"\0" * 64, 0, 64))
    assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT",
                                         "failed to register shared memory region: invalid args")
    e = error_of(lambda: h.register_cuda_shared_memory("c", b"\0" * 64, 0, 64))
    assert (e.status(), e.message()) == ("400", "'raw_handle' must be a valid base64 encoded "
                                                "cudaIpcMemHandle_t")
    e = error_of(lambda: h.register_cuda_shared_memory(
        "c", base64.b64encode(b"\0" * 64), 0, 64))
    assert (e.status(), e.message()) == ("400", "failed to register shared memory region: "
                                                "invalid args")
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
        unregister(g, "cuda_in", cuda=True)
    finally:
        cudashm.destroy_shared_memory_region(handle)
