"""KServe v2 over gRPC against a live server, through the official `tritonclient.grpc` (sync,
aio, streaming) and Triton's generated stubs for what the client does not expose (typed
contents, parameter kinds). Values, Triton's status codes and exact texts, and batching proven
by the statistics extension; every negative test ends with a liveness check.

Shared memory (system regions over both protocols, `tritonclient.utils.shared_memory`) is in
test_shared_memory.py; this module owns the RPCs themselves.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.v2_target import continuum_only, deviation, settled_stats, wait_unloaded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    yield c
    c.close()


def simple_inputs(a, b, mod=grpcclient):
    ins = [mod.InferInput("INPUT0", list(a.shape), "INT32"),
           mod.InferInput("INPUT1", list(b.shape), "INT32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def alive(c) -> None:
    """The liveness check that ends every negative test: a correct inference."""
    r = c.infer("simple", simple_inputs(A, B))
    assert (r.as_numpy("OUTPUT0") == A + B).all()


def error_of(fn) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        fn()
    return info.value


def stub(address: str):
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address))


# -- health, metadata, config, statistics ------------------------------------------------------
def test_server_and_model_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert {"system_shared_memory", "cuda_shared_memory", "statistics",
            "model_repository"} <= set(meta.extensions)
    m = client.get_model_metadata("simple")
    assert m.platform == "python" and m.versions == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == \
        [("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    cfg = client.get_model_config("simple").config
    assert cfg.name == "simple" and cfg.max_batch_size == 8
    assert client.is_model_ready("simple")


def test_unknown_model_is_not_found(client):
    for call in (lambda: client.get_model_metadata("nosuch"),
                 lambda: client.get_model_config("nosuch"),
                 lambda: client.infer("nosuch", simple_inputs(A, B))):
        e = error_of(call)
        assert e.status() == "StatusCode.NOT_FOUND"
        assert e.message() == "Request for unknown model: 'nosuch' is not found"
    assert client.is_model_ready("nosuch") is False        # ready false, not an error
    e = error_of(lambda: client.get_inference_statistics("nosuch"))
    assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT",
                                         "requested model 'nosuch' is not available")
    alive(client)


def test_infer_raw_and_statistics(client):
    before = client.get_inference_statistics("simple").model_stats[0].inference_count
    r = client.infer("simple", simple_inputs(np.vstack([A, A]), np.vstack([B, B])),
                     request_id="r-1")
    assert r.get_response().id == "r-1" and r.get_response().model_version == "1"
    assert (r.as_numpy("OUTPUT0") == np.vstack([A, A]) + 3).all()
    assert (r.as_numpy("OUTPUT1") == np.vstack([A, A]) - 3).all()
    stats = settled_stats(lambda: client.get_inference_statistics("simple").model_stats[0],
                          lambda s: s.inference_count >= before + 2)
    assert stats.inference_count == before + 2 and stats.inference_stats.success.count >= 1


def test_infer_typed_contents_equals_raw(v2_servers, client):
    s = stub(v2_servers["main"][1])
    req = pb.ModelInferRequest(model_name="simple")
    for name, data in (("INPUT0", A), ("INPUT1", B)):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend(data.ravel().tolist())
    resp = s.ModelInfer(req)
    assert [o.name for o in resp.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert (np.frombuffer(resp.raw_output_contents[0], np.int32) == (A + B).ravel()).all()
    # BYTES through bytes_contents and through raw contents give the same ids
    text = np.array([[b"hello world"]], dtype=np.object_)
    typed = pb.ModelInferRequest(model_name="text_tokenizer")
    typed.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(
        b"hello world")
    via_typed = s.ModelInfer(typed)
    raw_in = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    raw_in.set_data_from_numpy(text)
    via_raw = client.infer("text_tokenizer", [raw_in])
    assert np.frombuffer(via_typed.raw_output_contents[0], np.int64).tolist() == \
        via_raw.as_numpy("input_ids").ravel().tolist()


@pytest.mark.parametrize("mutate, code, text", [
    (lambda r: r.inputs[0].contents.fp32_contents.extend([1.0] * 16), "INVALID_ARGUMENT",
     "contents field must not be specified when using raw_input_contents for 'INPUT0' for "
     "model 'simple'"),
    (lambda r: r.raw_input_contents.pop(), "INVALID_ARGUMENT",
     "unable to find data for input tensor 'INPUT1' for model 'simple' in request."),
    (lambda r: r.raw_input_contents.__setitem__(1, b"\0" * 60), "INVALID_ARGUMENT",
     "[request id: <id_unknown>] input byte size mismatch for input 'INPUT1' for model "
     "'simple'. Expected 64, got 60"),
    (lambda r: setattr(r.inputs[0], "datatype", "FP32"), "INVALID_ARGUMENT",
     "[request id: <id_unknown>] inference input 'INPUT0' data-type is 'FP32', but model "
     "'simple' expects 'INT32'"),
    (lambda r: r.parameters["priority"].CopyFrom(pb.InferParameter(string_param="high")),
     "INVALID_ARGUMENT", "invalid value type for 'priority' parameter, expected int64_param or "
     "uint64_param."),
    (lambda r: r.parameters["triton_x"].CopyFrom(pb.InferParameter(bool_param=True)),
     "INVALID_ARGUMENT", "parameter keys starting with 'triton_' are reserved for Triton usage. "
     "Only the following keys starting with 'triton_' are allowed: "
     "triton_enable_empty_final_response"),
    (lambda r: r.inputs.add(name="EXTRA", datatype="INT32", shape=[1, 16]), "INVALID_ARGUMENT",
     "unable to find data for input tensor 'EXTRA' for model 'simple' in request."),
])
def test_bad_requests_get_triton_codes_and_texts(v2_servers, client, mutate, code, text):
    req = pb.ModelInferRequest(model_name="simple")
    for name, data in (("INPUT0", A), ("INPUT1", B)):
        req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        req.raw_input_contents.append(data.tobytes())
    mutate(req)
    with pytest.raises(grpc.RpcError) as info:
        stub(v2_servers["main"][1]).ModelInfer(req)
    assert info.value.code().name == code
    assert info.value.details() == text
    alive(client)


def test_concurrent_grpc_and_http_requests_batch_together(v2_servers, client):
    """16 gRPC (aio) and 8 HTTP requests at once on a 300 ms model with a 100 ms queue delay:
    they are answered correctly and run in fewer executions than requests."""
    before = client.get_inference_statistics("delayed").model_stats[0]

    async def grpc_side():
        c = grpcaio.InferenceServerClient(v2_servers["main"][1])
        try:
            async def one(i):
                x = grpcaio.InferInput("IN", [1, 1], "INT32")
                x.set_data_from_numpy(np.array([[i]], np.int32))
                return (await c.infer("delayed", [x])).as_numpy("OUT")[0, 0]
            return await asyncio.gather(*[one(i) for i in range(16)])
        finally:
            await c.close()

    def http_one(i):
        h = httpclient.InferenceServerClient(v2_servers["main"][0].removeprefix("http://"))
        x = httpclient.InferInput("IN", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[100 + i]], np.int32))
        return h.infer("delayed", [x]).as_numpy("OUT")[0, 0]

    with ThreadPoolExecutor(8) as pool:
        http_results = pool.map(http_one, range(8))
        grpc_results = asyncio.run(grpc_side())
        assert list(http_results) == [100 + i for i in range(8)]
    assert list(grpc_results) == list(range(16))
    after = settled_stats(lambda: client.get_inference_statistics("delayed").model_stats[0],
                          lambda a: a.inference_count - before.inference_count >= 24)
    requests = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert requests == 24 and executions < requests


def test_a_burst_of_calls_to_a_cheap_model_runs_in_batches(v2_servers, client):
    """24 calls at once (grpc.aio), three times, to a model cheap enough to run on the
    completion-queue thread: they run in fewer executions than calls, as Triton batches
    them; each gets its own answer."""
    async def bursts():
        c = grpcaio.InferenceServerClient(v2_servers["main"][1])
        try:
            async def one(i):
                x = grpcaio.InferInput("IN", [1, 1], "INT32")
                x.set_data_from_numpy(np.array([[i]], np.int32))
                return int((await c.infer("cheap", [x])).as_numpy("OUT")[0, 0])
            for _ in range(20):                  # measured first, one call at a time
                await one(0)
            return [await asyncio.gather(*[one(i) for i in range(24)]) for _ in range(3)]
        finally:
            await c.close()

    before = client.get_inference_statistics("cheap").model_stats[0]
    results = asyncio.run(bursts())
    after = client.get_inference_statistics("cheap").model_stats[0]
    assert results == [list(range(24))] * 3
    calls = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert calls == 92 and executions < 92, executions      # 20 alone, 72 in bursts


def test_a_burst_past_grpcs_pending_call_limits_is_answered_in_full(v2_servers, client):
    """3,500 calls at once on one channel (a load generator at high concurrency): every call
    gets its own answer. grpcio's server drops calls it holds unrequested past 1,000 at random
    and past 3,000 always (CANCELLED) unless told otherwise; tritonserver 2.51 answers all."""
    async def burst():
        c = grpcaio.InferenceServerClient(v2_servers["main"][1])
        try:
            async def one(i):
                a = np.full((1, 16), i, np.int32)
                r = await c.infer("simple", simple_inputs(a, B, grpcaio))
                return int(r.as_numpy("OUTPUT0")[0, 0]) - 3
            return await asyncio.gather(*[one(i) for i in range(3500)],
                                        return_exceptions=True)
        finally:
            await c.close()

    results = asyncio.run(burst())
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, (len(failed), str(failed[0])[:200])
    assert results == list(range(3500))
    alive(client)


def test_many_clients_at_once_each_get_their_own_answers(v2_servers):
    """8 clients, each on its own channel, 40 requests each with its own inputs, all at once:
    every answer is the sum and difference of that request's inputs (the completion-queue
    loop answers calls from whichever thread finished them)."""
    def client_run(k):
        c = grpcclient.InferenceServerClient(v2_servers["main"][1])
        try:
            wrong = 0
            for i in range(40):
                a = np.full((1, 16), 1000 * k + i, np.int32)
                r = c.infer("simple", simple_inputs(a, B), request_id=f"{k}-{i}")
                wrong += r.get_response().id != f"{k}-{i}"
                wrong += not (r.as_numpy("OUTPUT0") == a + B).all()
                wrong += not (r.as_numpy("OUTPUT1") == a - B).all()
            return wrong
        finally:
            c.close()

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(client_run, range(8))) == 0


def test_expired_deadlines_and_bad_calls_leave_the_others_answered(v2_servers, client):
    """Calls whose client deadline passes while the 300 ms model runs end with
    DEADLINE_EXCEEDED and the requests beside them are answered; an unknown method gets
    UNIMPLEMENTED and bytes that are no ModelInferRequest get INTERNAL, as tritonserver's
    gRPC C++ server answers them."""
    channel = grpc.insecure_channel(v2_servers["main"][1])
    raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "Unable to parse request"
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/inference.GRPCInferenceService/NoSuchRpc")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.details() == ""

    def one(i):
        x = grpcclient.InferInput("IN", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[i]], np.int32))
        timeout = 0.05 if i % 2 else None
        try:
            return client.infer("delayed", [x], client_timeout=timeout).as_numpy("OUT")[0, 0]
        except InferenceServerException as e:
            return e.status()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert results[0::2] == [0, 2, 4, 6]
    assert all("DEADLINE_EXCEEDED" in str(r) for r in results[1::2]), results
    channel.close()
    alive(client)


# -- streaming -----------------------------------------------------------------------------------
def test_stream_answers_in_order_and_survives_a_failed_request(client):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(6):
            if i == 3:
                client.async_stream_infer("nosuch", simple_inputs(A, B), request_id="bad")
                continue
            client.async_stream_infer("simple", simple_inputs(A + i, B), request_id=str(i))
        got = [results.get(timeout=30) for _ in range(6)]
    finally:
        client.stop_stream()
    assert [r.get_response().id if r else "bad" for r, _ in got] == ["0", "1", "2", "bad", "4",
                                                                      "5"]
    for i, (result, error) in enumerate(got):
        if i == 3:
            assert result is None and "Request for unknown model: 'nosuch' is not found" in \
                error.message()
            continue
        assert error is None
        assert (result.as_numpy("OUTPUT0") == A + i + B).all()
        assert result.get_response().parameters["triton_final_response"].bool_param
    alive(client)


def test_stream_requests_batch_together(client):
    before = client.get_inference_statistics("delayed").model_stats[0]
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(8):
            x = grpcclient.InferInput("IN", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[i]], np.int32))
            client.async_stream_infer("delayed", [x], request_id=str(i))
        got = [results.get(timeout=30) for _ in range(8)]
    finally:
        client.stop_stream()
    assert [int(r.as_numpy("OUT")[0, 0]) for r, _ in got] == list(range(8))
    after = client.get_inference_statistics("delayed").model_stats[0]
    assert after.execution_count - before.execution_count < 8


# -- repository, restrictions -------------------------------------------------------------------
def test_repository_index_unload_and_load_with_config_override(client):
    names = {m.name: m.state for m in client.get_model_repository_index().models}
    assert names["simple"] == "READY"
    config = json.loads(json.dumps({"name": "simple", "backend": "python", "max_batch_size": 2,
                                    "input": [{"name": n, "data_type": "TYPE_INT32",
                                               "dims": [16]} for n in ("INPUT0", "INPUT1")],
                                    "output": [{"name": n, "data_type": "TYPE_INT32",
                                                "dims": [16]} for n in ("OUTPUT0", "OUTPUT1")]}))
    try:
        client.unload_model("simple")
        wait_unloaded(client, "simple")
        assert not client.is_model_ready("simple")
        client.load_model("simple", config=json.dumps(config))
        assert client.get_model_config("simple").config.max_batch_size == 2
        e = error_of(lambda: client.infer("simple", simple_inputs(np.vstack([A] * 3),
                                                                   np.vstack([B] * 3))))
        assert e.message() == ("[request id: <id_unknown>] inference request batch-size must "
                               "be <= 2 for 'simple'")
        e = error_of(lambda: client.load_model("simple", config="{not json"))
        assert e.status() == deviation("load-failure-reason", continuum="StatusCode.INVALID_"
                                       "ARGUMENT", triton="StatusCode.INTERNAL")
        assert e.message().startswith("failed to load 'simple', failed to poll from model "
                                      "repository")
        assert client.is_model_ready("simple")     # a failed reload leaves it serving
        client.load_model("simple")          # files unchanged: nothing to load, as Triton
        assert client.get_model_config("simple").config.max_batch_size == 2
    finally:
        client.unload_model("simple")
        wait_unloaded(client, "simple")
        client.load_model("simple")
    assert client.get_model_config("simple").config.max_batch_size == 8
    alive(client)


def test_restricted_protocol(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["locked"][1])
    try:
        for call in (lambda h: c.get_model_repository_index(headers=h),
                     lambda h: c.get_inference_statistics("simple", headers=h)):
            e = error_of(lambda: call(None))
            assert e.status() == "StatusCode.UNAVAILABLE"
            assert e.message() == ("This protocol is restricted, expecting header "
                                   "'triton-grpc-protocol-admin-key'")
            e = error_of(lambda: call({"triton-grpc-protocol-admin-key": "wrong"}))
            assert e.status() == "StatusCode.UNAVAILABLE"
            call({"triton-grpc-protocol-admin-key": "s3cret"})
        alive(c)
    finally:
        c.close()


@continuum_only("--allow-client-shm is newer than tritonserver 2.51 (always on there)")
def test_client_shm_off_is_refused_as_a_restricted_api(v2_servers):
    """With client shared memory off (the default), its RPCs are refused as Triton refuses a
    restricted API (UNAVAILABLE, a client-side condition), not UNIMPLEMENTED as current
    Triton does, which load balancers read as a server fault; the status RPC lists nothing
    (deviation "client-shm-off")."""
    c = grpcclient.InferenceServerClient(v2_servers["locked"][1])
    try:
        e = error_of(lambda: c.register_system_shared_memory("r", "/k", 64))
        assert e.status() == "StatusCode.UNAVAILABLE"
        assert e.message() == ("Client shared memory is disabled. Start the server with "
                               "'--allow-client-shm=true' to enable.")
        assert len(c.get_system_shared_memory_status().regions) == 0
        alive(c)
    finally:
        c.close()


def test_a_stream_cancelled_mid_flight_leaves_the_server_serving(client):
    """The client cancels a stream while its requests run: they still finish on the server
    (statistics), and new requests are served."""
    before = client.get_inference_statistics("delayed").model_stats[0].inference_count
    client.start_stream(callback=lambda result, error: None)
    for i in range(4):
        x = grpcclient.InferInput("IN", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[i]], np.int32))
        client.async_stream_infer("delayed", [x])
    time.sleep(0.15)                 # received and queued (100 ms delay, then 300 ms to run)
    client.stop_stream(cancel_requests=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        done = client.get_inference_statistics("delayed").model_stats[0].inference_count
        if done - before == 4:
            break
        time.sleep(0.2)
    assert done - before == 4
    alive(client)


def test_triton_grpc_error_mode_ends_the_stream_with_the_status(client):
    """With metadata `triton_grpc_error: true`, the first request the model fails ends the
    stream with its gRPC status (Triton's opt-in), instead of an error_message response; a
    request refused before it runs (unknown model) is still an error_message, as in
    tritonserver 2.51 (stream_infer_handler.cc checks the mode only on model responses)."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("simple", simple_inputs(A, B), request_id="ok")
        client.async_stream_infer("nosuch", simple_inputs(A, B), request_id="refused")
        first, second = results.get(timeout=30), results.get(timeout=30)
        x = grpcclient.InferInput("IN", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[-1]], np.int32))     # fails its own response
        client.async_stream_infer("delayed", [x], request_id="bad")
        third = results.get(timeout=30)
    finally:
        client.stop_stream()
    assert first[1] is None and first[0].get_response().id == "ok"
    assert second[0] is None and second[1].status() is None
    assert second[1].message() == "Request for unknown model: 'nosuch' is not found"
    assert third[0] is None
    assert (third[1].status(), third[1].message()) == ("StatusCode.INTERNAL",
                                                       "request failed on purpose")
    alive(client)


@pytest.mark.parametrize("user, turned_off, after", [
    (None, True, None),                                   # set for the import, then removed
    ("some_experiment", True, "some_experiment"),         # the user's value comes back
    ("event_engine_listener", False, "event_engine_listener"),   # the user's choice stands
])
def test_grpc_is_imported_with_loop_thread_io_and_the_environment_restored(user, turned_off,
                                                                           after):
    """`continuum serve` imports grpc with C-core's EventEngine I/O off (socket I/O on the gRPC
    loop thread); child processes (the engine, ray workers) never inherit the setting."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if user is not None:
        env["GRPC_EXPERIMENTS"] = user
    code = ("import os, sys; from triton_compat.frontend.grpc.core_env import import_grpc; "
            "r = import_grpc(); print(r, 'grpc' in sys.modules, "
            "os.environ.get('GRPC_EXPERIMENTS'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(turned_off), "True", str(after)]


def _echo_loop_server(on_call=lambda: None):
    """grpc/loop.py's `Server` alone, its ModelInfer answering each request with its model
    name and id (after calling `on_call()` on the loop thread); not started, no port."""
    from triton_compat.frontend.grpc.loop import Server
    from triton_compat.frontend.grpc.server import WORKERS

    def model_infer(data, metadata, reply):
        on_call()
        msg = pb.ModelInferRequest.FromString(data)
        reply(pb.ModelInferResponse(model_name=msg.model_name, id=msg.id))

    return Server(service_pb2_grpc.GRPCInferenceServiceServicer(),
                  service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                  {"ModelInfer": model_infer}, options=[], workers=WORKERS)


@continuum_only("Continuum's completion-queue loop, run in the test's process")
def test_the_loop_polls_while_calls_follow_closely_and_idles_after():
    """grpc/loop.py polls without blocking for a moment after each event while calls arrive
    closely (a virtual machine's wake-up is much of a small call's latency), and blocks again
    once they stop: 300 back-to-back calls, then one second idle costs the loop thread no CPU
    to speak of (a loop still spinning would burn the whole second)."""
    import os
    import threading

    from triton_compat.frontend.grpc.loop import SPIN_S

    server = _echo_loop_server()
    port = server.add_insecure_port("127.0.0.1:0")
    before = {t.ident for t in threading.enumerate()}
    server.start()
    try:
        s = stub(f"127.0.0.1:{port}")
        for i in range(300):
            assert s.ModelInfer(pb.ModelInferRequest(model_name="m", id=str(i))).id == str(i)
        loop = next(t for t in threading.enumerate()
                    if t.name == "grpc-loop" and t.ident not in before)   # this server's

        def cpu_ticks() -> int:         # the loop thread's user + system time, clock ticks
            fields = open(f"/proc/self/task/{loop.native_id}/stat").read().rsplit(")", 1)[1]
            return sum(int(x) for x in fields.split()[11:13])

        time.sleep(20 * SPIN_S)         # any spin after the last call has ended by now
        idle = cpu_ticks()
        time.sleep(1.0)
        assert cpu_ticks() - idle <= 0.05 * os.sysconf("SC_CLK_TCK")
        assert s.ModelInfer(pb.ModelInferRequest(model_name="m", id="after")).id == "after"
    finally:
        server.stop(None).wait(5)


@continuum_only("Continuum's completion-queue loop, run in the test's process")
def test_a_call_that_wakes_the_idle_loop_keeps_the_cpus_awake_for_its_answer():
    """A call arriving after the loop blocked (calls 10 ms apart, as one client with think
    time, or perf_analyzer c1 on a slow step) moves the process's `HaltPoll` window forward
    before its handler runs: its client's CPU halted while the loop waited, and waking it for
    the answer cost ~1 ms of p99 on a 2-CPU guest (grpc/loop.py `Server._next_event`)."""
    warmed: list[float] = []
    handled: list[float] = []

    class RecordingHalt:                # engine/halt_poll.HaltPoll's one method the loop calls
        def keep_warm(self, seconds: float) -> None:
            warmed.append(time.perf_counter())

    server = _echo_loop_server(on_call=lambda: handled.append(time.perf_counter()))
    server._halt = RecordingHalt()      # whether or not this host runs the real one
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        s = stub(f"127.0.0.1:{port}")
        s.ModelInfer(pb.ModelInferRequest(model_name="m", id="first"))
        sent = []
        for i in range(10):
            time.sleep(0.01)            # far past SPIN_S: the loop blocks in between
            sent.append(time.perf_counter())
            assert s.ModelInfer(pb.ModelInferRequest(model_name="m", id=str(i))).id == str(i)
        late = [i for i, (t0, t1) in enumerate(zip(sent, handled[1:]))
                if not any(t0 <= t <= t1 for t in warmed)]
        assert late == []
        assert s.ModelInfer(pb.ModelInferRequest(model_name="m", id="after")).id == "after"
    finally:
        server.stop(None).wait(5)
