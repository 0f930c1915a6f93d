"""The sequence batcher against a live server, with tritonclient over HTTP and gRPC.

Models (tests/triton_servers.py, SEQUENCE_MODELS): tests/triton_models/sequence_model.py keeps a
running sum in the implicit state ACC and echoes the control inputs it saw. `seq_direct` has
4 direct slots, `seq_oldest` 8 candidate sequences batched 4 at most, `seq_string` string ids,
`seq_idle` one slot and a 400 ms idle limit. Every negative test ends with a liveness check.
Runs against tritonserver 2.51 too (tests/v2_target.py): there a python model's implicit
state never changes (its python backend has no state API), so the sums are each value alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.v2_target import continuum_only, deviation, differs, settled_stats

pytestmark = pytest.mark.slow
OUTPUTS = ("OUT", "CTRL", "CORR", "FLAGS", "BATCH")
_local = threading.local()


def http_client(base: str) -> httpclient.InferenceServerClient:
    """One client per thread: tritonclient.http's client is not thread-safe."""
    if getattr(_local, "base", None) != base:
        _local.client, _local.base = httpclient.InferenceServerClient(base[len("http://"):]), base
    return _local.client


def send(base, model, sid, x, start=False, end=False, mod=httpclient, client=None, **kw):
    """One request of sequence `sid`; the outputs as plain lists."""
    c = client or http_client(base)
    i = mod.InferInput("IN", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[x]], np.int32))
    r = c.infer(model, [i], sequence_id=sid, sequence_start=start, sequence_end=end, **kw)
    return {k: r.as_numpy(k).tolist() for k in OUTPUTS}


def run_sequence(base, model, sid, values):
    """A whole sequence, request after request; its running sums."""
    return [send(base, model, sid, v, start=k == 0, end=k == len(values) - 1)["OUT"][0][0]
            for k, v in enumerate(values)]


def running(values) -> list:
    """What sequence_model.py answers over a sequence of `values`: their running sums (its
    implicit state), or on tritonserver each value alone (the state stays at zero)."""
    return deviation("python-implicit-state", continuum=list(itertools.accumulate(values)),
                     triton=list(values))


def stats(base, model):
    return httpx.get(f"{base}/v2/models/{model}/stats").json()["model_stats"][0]


def alive(base):
    assert send(base, "seq_direct", 999, 3, start=True, end=True)["OUT"] == [[3]]


def test_sixteen_sequences_share_four_direct_slots(v2_servers):
    base = v2_servers["main"][0]
    before = stats(base, "seq_direct")
    with cf.ThreadPoolExecutor(16) as ex:
        sums = list(ex.map(lambda s: run_sequence(base, "seq_direct", s, [s] * 5), range(1, 17)))
    assert sums == [running([s] * 5) for s in range(1, 17)]
    after = settled_stats(lambda: stats(base, "seq_direct"),
                          lambda a: a["inference_count"] - before["inference_count"] >= 80)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 80 and executions < inferences
    assert max(b["batch_size"] for b in after["batch_stats"]) == 4


def test_the_model_sees_controls_flags_and_the_correlation_id(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        kw = dict(mod=grpcclient, client=c)
        first = send(None, "seq_direct", 4242, 2, start=True, **kw)
        middle = send(None, "seq_direct", 4242, 3, **kw)
        last = send(None, "seq_direct", 4242, 4, end=True, **kw)
    finally:
        c.close()
    assert [first["OUT"][0][0], middle["OUT"][0][0], last["OUT"][0][0]] == running([2, 3, 4])
    # CTRL: START, END, READY as the model saw them
    assert [first["CTRL"], middle["CTRL"], last["CTRL"]] == \
        [[[1, 0, 1]], [[0, 0, 1]], [[0, 1, 1]]]
    assert [first["FLAGS"], middle["FLAGS"], last["FLAGS"]] == [[[1]], [[0]], [[2]]]
    assert first["CORR"] == last["CORR"] == [[4242]]


def test_direct_pads_empty_slots_with_not_ready_requests(v2_servers):
    base = v2_servers["main"][0]
    send(base, "seq_direct", 501, 1, start=True)          # slot 0
    send(base, "seq_direct", 502, 1, start=True)          # slot 1
    send(base, "seq_direct", 501, 1, end=True)            # slot 0 free again
    before = stats(base, "seq_direct")
    out = send(base, "seq_direct", 502, 5, end=True)      # slot 0 empty: padding
    assert out["OUT"] == [[running([1, 5])[-1]]] and out["BATCH"] == [[2]]
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    after = {b["batch_size"]: b["compute_infer"]["count"]
             for b in stats(base, "seq_direct")["batch_stats"]}
    assert after[2] == sizes.get(2, 0) + 1                # counted at its padded size


def test_oldest_batches_sequences_without_padding(v2_servers):
    base = v2_servers["main"][0]
    before = stats(base, "seq_oldest")

    def one(s):
        out = [send(base, "seq_oldest", s, s, start=k == 0, end=k == 3) for k in range(4)]
        return [o["OUT"][0][0] for o in out], [o["BATCH"][0][0] for o in out]

    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(1, 9)))
    assert [sums for sums, _ in results] == [running([s] * 4) for s in range(1, 9)]
    assert max(b for _, batches in results for b in batches) <= 4
    after = settled_stats(lambda: stats(base, "seq_oldest"),
                          lambda a: a["inference_count"] - before["inference_count"] >= 32)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 32 and executions < inferences
    rows = sum(b["batch_size"] * b["compute_infer"]["count"] for b in after["batch_stats"])
    assert rows == after["inference_count"]               # no padding rows


@differs("string-corrid")
def test_string_correlation_ids_over_grpc(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        kw = dict(mod=grpcclient, client=c)
        a = [send(None, "seq_string", "user-a", 1, start=True, **kw),
             send(None, "seq_string", "user-b", 10, start=True, **kw),
             send(None, "seq_string", "user-a", 2, end=True, **kw),
             send(None, "seq_string", "user-b", 20, end=True, **kw)]
    finally:
        c.close()
    assert [o["OUT"][0][0] for o in a] == [1, 10, 3, 30]
    assert a[0]["CORR"] == [[b"user-a"]] and a[3]["CORR"] == [[b"user-b"]]


def test_a_string_id_on_an_integer_corrid_model_runs_as_in_triton(v2_servers):
    """tritonserver 2.51 runs a string sequence id on a UINT64 CORRID model: the sequence is
    the string, and CORRID holds the string's 4-byte length then its bytes, cut to 8 bytes."""
    base = v2_servers["main"][0]
    first = send(base, "seq_direct", "abc", 2, start=True)
    last = send(base, "seq_direct", "abc", 3, end=True)
    assert [first["OUT"][0][0], last["OUT"][0][0]] == running([2, 3])
    assert first["CORR"] == last["CORR"] == [[0x0063626100000003]]
    alive(base)


def _post(base, model, body):
    return httpx.post(f"{base}/v2/models/{model}/infer", json=body)


def _body(params, shape=(1, 1), extra=()):
    data = np.ones(shape, np.int32)
    inputs = [{"name": "IN", "shape": list(shape), "datatype": "INT32",
               "data": data.reshape(-1).tolist()}, *extra]
    return {"inputs": inputs, "parameters": params}


START_INPUT = ({"name": "START", "shape": [1, 1], "datatype": "INT32", "data": [1]},)


@pytest.mark.parametrize("model,body,text", [
    ("seq_direct", _body({"sequence_id": 77}),
     "inference request for sequence 77 to model 'seq_direct' must specify the START flag "
     "on the first request of the sequence"),
    ("seq_direct", _body({"sequence_id": 0, "sequence_start": True}),
     "inference request to model 'seq_direct' must specify a non-zero or non-empty "
     "correlation ID"),
    ("seq_direct", _body({"sequence_start": True}), "must specify a non-zero or non-empty"),
    ("seq_direct", _body({"sequence_id": 5, "sequence_start": True}, shape=(2, 1)),
     "inference request to model 'seq_direct' must specify batch-size 1 due to requirements "
     "of sequence batcher"),
    ("seq_direct", _body({"sequence_id": 5, "sequence_start": True}, extra=START_INPUT),
     "expected 1 inputs but got 2 inputs for model 'seq_direct'. Got input(s) "
     "['START','IN'], but missing required input(s) ]."),
    ("seq_string", _body({"sequence_id": 0, "sequence_start": True}),
     "inference request to model 'seq_string' must specify a non-zero or non-empty "
     "correlation ID"),
    ("seq_direct", _body({"sequence_id": "", "sequence_start": True}),
     "inference request to model 'seq_direct' must specify a non-zero or non-empty "
     "correlation ID"),
])
def test_bad_sequence_requests_get_triton_texts(v2_servers, model, body, text):
    base = v2_servers["main"][0]
    r = _post(base, model, body)
    assert r.status_code == 400 and text in r.json()["error"]
    alive(base)


@pytest.mark.parametrize("model,body,status,text", [
    ("seq_direct", _body({"sequence_id": 5, "sequence_start": "yes"}),
     deviation("client-error-4xx", continuum=400, triton=500),
     "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean"),
    ("seq_direct", _body({"sequence_id": [5], "sequence_start": True}),
     deviation("client-error-4xx", continuum=400, triton=500),
     "Unable to parse 'sequence_id': attempt to access JSON non-string as string"),
    ("seq_string", _body({"sequence_id": "x" * 129, "sequence_start": True}), 501,
     "string correlation ID cannot be longer than 128 characters"),
    ("seq_direct", _body({"sequence_id": "x" * 129, "sequence_start": True}), 501,
     "string correlation ID cannot be longer than 128 characters"),
])
def test_malformed_sequence_ids_and_flags(v2_servers, model, body, status, text):
    base = v2_servers["main"][0]
    r = _post(base, model, body)
    assert (r.status_code, r.json()) == (status, {"error": text})
    alive(base)


@differs("integer-id-on-string-corrid")
def test_an_integer_id_on_a_string_corrid_model_is_refused(v2_servers):
    base = v2_servers["main"][0]
    r = _post(base, "seq_string", _body({"sequence_id": 12, "sequence_start": True}))
    assert (r.status_code, r.json()["error"]) == (400, (
        "sequence batching control 'CORRID' data-type is 'UINT64', but model 'seq_string' "
        "expects 'BYTES'"))
    alive(base)


def test_state_output_must_be_a_model_output_to_be_requested(v2_servers):
    base = v2_servers["main"][0]
    body = _body({"sequence_id": 31, "sequence_start": True, "sequence_end": True})
    r = _post(base, "seq_direct", {**body, "outputs": [{"name": "ACC_OUT"}]})
    assert r.status_code == 400
    assert r.json()["error"] == "unexpected inference output 'ACC_OUT' for model 'seq_direct'"
    alive(base)


def test_a_second_start_restarts_the_sequence(v2_servers):
    base = v2_servers["main"][0]
    assert send(base, "seq_direct", 61, 5, start=True)["OUT"] == [[5]]
    assert send(base, "seq_direct", 61, 5)["OUT"] == [[running([5, 5])[-1]]]
    assert send(base, "seq_direct", 61, 7, start=True)["OUT"] == [[7]]     # state re-created
    assert send(base, "seq_direct", 61, 1, end=True)["OUT"] == [[running([7, 1])[-1]]]


def test_an_idle_sequence_loses_its_slot(v2_servers):
    base = v2_servers["main"][0]
    send(base, "seq_idle", 71, 1, start=True)
    time.sleep(1.0)                                       # > max_sequence_idle (400 ms)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        send(base, "seq_idle", 71, 1)
    assert run_sequence(base, "seq_idle", 72, [1, 2]) == running([1, 2])   # the slot is free
    alive(base)


def test_backlogged_sequences_wait_and_expire_on_their_timeout(v2_servers):
    base = v2_servers["main"][0]
    send(base, "seq_idle", 81, 1, start=True)             # holds the only slot
    with cf.ThreadPoolExecutor(1) as ex:
        waiting = ex.submit(run_sequence, base, "seq_idle", 82, [5, 5])   # backlog
        time.sleep(0.2)
        assert not waiting.done()
        send(base, "seq_idle", 81, 1, end=True)
        assert waiting.result(timeout=10) == running([5, 5])     # never an error
    send(base, "seq_idle", 83, 1, start=True)
    r = _post(base, "seq_idle", _body({"sequence_id": 84, "sequence_start": True,
                                        "timeout": 100_000}))
    assert r.status_code == 503
    assert r.json()["error"] == "timeout of the corresponding sequence has been expired"
    send(base, "seq_idle", 83, 1, end=True)
    alive(base)


def test_bad_sequence_configs_fail_to_load_with_triton_texts(v2_servers):
    """A config that fails Triton's sequence-batching checks does not load (Triton's text for
    a version that fails) and the loaded version goes on serving."""
    base = v2_servers["main"][0]
    config = httpx.get(f"{base}/v2/models/seq_idle/config").json()
    bad = json.loads(json.dumps(config))
    bad["sequence_batching"]["control_input"][0]["control"][0]["int32_false_true"] = [0, 1, 2]
    r = httpx.post(f"{base}/v2/repository/models/seq_idle/load",
                   json={"parameters": {"config": json.dumps(bad)}})
    assert r.status_code == deviation("load-failure-reason", continuum=400, triton=500)
    assert r.json()["error"].startswith("failed to load 'seq_idle', failed to poll from model "
                                        "repository")
    assert deviation("load-failure-reason", triton="", continuum="sequence batching control "
                     "'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START "
                     "for seq_idle") in r.json()["error"]
    bad = json.loads(json.dumps(config))
    bad["sequence_batching"]["state"][0]["initial_state"][0]["dims"] = [2]
    r = httpx.post(f"{base}/v2/repository/models/seq_idle/load",
                   json={"parameters": {"config": json.dumps(bad)}})
    assert (r.status_code, r.json()["error"]) == (400, (
        "load failed for model 'seq_idle': version 1 is at UNAVAILABLE state: Invalid "
        "argument: 'initial_state' dim for input name 'ACC' doesn't match 'state' dim "
        "description. 2 != 1;\n"))
    assert run_sequence(base, "seq_idle", "again", [4, 4]) == running([4, 4])   # still serving
    r = httpx.post(f"{base}/v2/repository/models/seq_idle/load", json={})
    assert r.status_code == 200
    assert run_sequence(base, "seq_idle", 7001, [4, 4]) == running([4, 4])
    alive(base)


def _generate_stream(base, model, body):
    with httpx.stream("POST", f"{base}/v2/models/{model}/generate_stream", json=body,
                      timeout=30) as r:
        return r.status_code, [json.loads(line[len("data: "):]) for line in r.iter_lines()
                               if line.startswith("data: ")]


def test_iterative_sequences_are_rescheduled_and_batched_with_new_requests(v2_servers):
    base = v2_servers["main"][0]
    before = stats(base, "iterative")
    status, events = _generate_stream(base, "iterative", {"IN": 3})
    assert status == 200 and [e["OUT"] for e in events] == [2, 1, 0]
    after = settled_stats(lambda: stats(base, "iterative"),
                          lambda a: a["inference_count"] - before["inference_count"] >= 3)   # each iteration counts
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] == 3
    assert after["inference_stats"]["success"]["count"] - \
        before["inference_stats"]["success"]["count"] == 3
    with cf.ThreadPoolExecutor(4) as ex:          # four at once: iterations share executions
        runs = list(ex.map(lambda n: _generate_stream(base, "iterative", {"IN": n}),
                           [6, 6, 6, 6]))
    assert all([e["OUT"] for e in events] == [5, 4, 3, 2, 1, 0] for _, events in runs)
    assert max(e["BATCH"] for _, events in runs for e in events) > 1


def test_iterative_requests_over_a_grpc_stream(v2_servers):
    import queue

    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        for rid, n in (("a", 2), ("b", 3)):
            x = grpcclient.InferInput("IN", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[n]], np.int32))
            c.async_stream_infer("iterative", [x], request_id=rid)
        out = [got.get(timeout=30) for _ in range(5)]
    finally:
        c.stop_stream()
        c.close()
    assert all(e is None for _, e in out)
    by_id: dict = {}
    for r, _ in out:
        by_id.setdefault(r.get_response().id, []).append(int(r.as_numpy("OUT")[0, 0]))
    assert by_id == {"a": [1, 0], "b": [2, 1, 0]}


def test_a_response_returned_for_a_rescheduled_request_fails_it(v2_servers):
    """A model that asks to run a request again must return None for it (the python backend's
    rule): a response instead fails that request with Triton's text, once."""
    base = v2_servers["main"][0]
    r = _post(base, "wrong_reschedule", _body({}))
    assert r.status_code == 500 and "Expected a None object in the execute function return " \
        "list for reschduled request" in r.json()["error"]
    alive(base)


@differs("reschedule-refused")
def test_rescheduling_without_iterative_sequence_is_refused(v2_servers):
    base = v2_servers["main"][0]
    status, events = _generate_stream(base, "not_iterative", {"IN": 2})
    assert events[-1] == {"error": "Request is released with "
                          "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not "
                          "configured to handle such a flag."}
    alive(base)


@continuum_only("a Continuum batch strategy (batch_strategy.py beside the config)")
def test_a_custom_batch_strategy_caps_the_batch_volume(v2_servers):
    """examples/batch_strategies/volume_batching.py as the model's batch_strategy.py: at
    most 12 bytes (three INT32 [1, 1] requests) per batch, though max_batch_size is 8."""
    base = v2_servers["main"][0]

    def one(i):
        body = {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT32", "data": [i]}]}
        r = httpx.post(f"{base}/v2/models/volume/infer", json=body, timeout=30).json()
        return {o["name"]: o["data"][0] for o in r["outputs"]}

    with cf.ThreadPoolExecutor(9) as ex:
        out = list(ex.map(one, range(9)))
    assert [o["OUT"] for o in out] == list(range(9))
    assert max(o["BATCH"] for o in out) == 3
    executions = {o["EXEC"] for o in out}
    assert len(executions) == 3                  # 9 requests, three per execution


@continuum_only("pytorch-backend model (the reference server has only the python backend)")
def test_pytorch_model_state_starts_from_its_data_file(v2_servers):
    """torch_state: OUT = ACC + IN with ACC from initial_state/start ([100, 200]) at START;
    the client may ask for ACC_OUT because it is also a model output."""
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])

    def step(sid, values, **flags):
        x = grpcclient.InferInput("IN", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([values], np.float32))
        r = c.infer("torch_state", [x], sequence_id=sid, **flags)
        return r.as_numpy("OUT").tolist(), r.as_numpy("ACC_OUT").tolist()

    try:
        assert step(1, [1, 2], sequence_start=True) == ([[101, 202]], [[101, 202]])
        assert step(2, [5, 5], sequence_start=True) == ([[105, 205]], [[105, 205]])
        assert step(1, [1, 2], sequence_end=True)[0] == [[102, 204]]
        assert step(2, [5, 5], sequence_end=True)[0] == [[110, 210]]
    finally:
        c.close()
