"""Ragged batching as Triton does it (batch_input / batch_output) on the onnxruntime backend,
one batch formed by hand: the cases and expected values of Triton's own qa test
(server qa/L0_batch_input/batch_input_test.py, models as qa/common/gen_qa_ragged_models.py
and its test.sh build them), the load-time checks with Triton core's texts, and the example
model served through tritonclient in a burst. tritonserver from nvidia-pytriton has no
onnxruntime backend, so these run against Continuum only."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from triton_compat.core.backends import BackendRequest
from triton_compat.core.backends.tensor import OnnxBackend
from triton_compat.core.config import ConfigError
from triton_compat.core.config_loader import load_config

F = TensorProto.FLOAT


def save(path, nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "m", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def batch_input_graph(path):
    """gen_qa_ragged_models' batch-input model: each output is its 1-D input as one row,
    repeated once per request (a ones column [R, 1] from BATCH_AND_SIZE_INPUT / itself)."""
    const = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(
        np.array(v, np.int64), n)) for n, v in (("row", [1, -1]), ("col", [-1, 1]))]
    nodes = const + [
        helper.make_node("Div", ["BATCH_AND_SIZE_INPUT", "BATCH_AND_SIZE_INPUT"], ["ones"]),
        helper.make_node("Reshape", ["ones", "col"], ["expander"])]
    for src, dst in (("RAGGED_INPUT", "RAGGED_OUTPUT"), ("BATCH_AND_SIZE_INPUT",
                     "BATCH_AND_SIZE_OUTPUT"), ("BATCH_INPUT", "BATCH_OUTPUT")):
        nodes += [helper.make_node("Reshape", [src, "row"], [src + "_row"]),
                  helper.make_node("MatMul", ["expander", src + "_row"], [dst])]
    save(path, nodes,
         [helper.make_tensor_value_info(n, F, [f"n{i}"]) for i, n in
          enumerate(("RAGGED_INPUT", "BATCH_AND_SIZE_INPUT", "BATCH_INPUT"))],
         [helper.make_tensor_value_info(n, F, ["r", f"c{i}"]) for i, n in
          enumerate(("RAGGED_OUTPUT", "BATCH_AND_SIZE_OUTPUT", "BATCH_OUTPUT"))])


def identity_graph(path, name_in, shape_in, name_out, shape_out):
    save(path, [helper.make_node("Identity", [name_in], [name_out])],
         [helper.make_tensor_value_info(name_in, F, shape_in)],
         [helper.make_tensor_value_info(name_out, F, shape_out)])


def batch_inputs(kinds):
    return " ".join(f'batch_input {{ kind: {k} target_name: "{t}" data_type: TYPE_FP32 '
                    f'source_input: "RAGGED_INPUT" }}' for t, k in kinds)


def model(tmp_path, name, text, build):
    build(tmp_path / name / "1" / "model.onnx")
    (tmp_path / name / "config.pbtxt").write_text(
        f'name: "{name}" backend: "onnxruntime" max_batch_size: 4 {text}')
    config = load_config(tmp_path / name)
    return OnnxBackend(config, tmp_path / name / "1" / "model.onnx")


def ragged_model(tmp_path, name, kinds, dims="-1"):
    outputs = " ".join(f'output {{ name: "{o}" data_type: TYPE_FP32 dims: [ -1 ] }}'
                       for o in ("RAGGED_OUTPUT", "BATCH_AND_SIZE_OUTPUT", "BATCH_OUTPUT"))
    return model(tmp_path, name,
                 f'input {{ name: "RAGGED_INPUT" data_type: TYPE_FP32 dims: [ {dims} ] '
                 f'allow_ragged_batch: true }} {outputs} {batch_inputs(kinds)}',
                 batch_input_graph)


def requests_of(shapes, name="RAGGED_INPUT", outputs=("RAGGED_OUTPUT", "BATCH_AND_SIZE_OUTPUT",
                                                         "BATCH_OUTPUT")):
    """L0_batch_input's requests: shape [1, n] (or as given) filled with n."""
    return [BackendRequest({name: np.full(s, s[1] if len(s) == 2 else 1, np.float32)},
                           list(outputs)) for s in shapes]


def run(backend, requests):
    results, _ = backend.execute(requests)
    assert not any(isinstance(r, Exception) for r in results), results
    return results


def test_element_counts_and_ragged_input(tmp_path):
    backend = ragged_model(tmp_path, "ragged_element_count_acc_zero",
                           [("BATCH_AND_SIZE_INPUT", "BATCH_ELEMENT_COUNT"),
                            ("BATCH_INPUT", "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO")])
    results = run(backend, requests_of([(1, 2), (1, 4), (1, 1), (1, 3)]))
    for r in results:     # every request's row is the whole batch's tensor (the model's doing)
        assert r["BATCH_AND_SIZE_OUTPUT"].tolist() == [[2, 4, 1, 3]]
        assert r["BATCH_OUTPUT"].tolist() == [[0, 2, 6, 7, 10]]
        assert r["RAGGED_OUTPUT"].tolist() == [[2, 2, 4, 4, 4, 4, 1, 3, 3, 3]]   # no padding


def test_accumulated_count_and_max_count_as_shape(tmp_path):
    backend = ragged_model(tmp_path, "ragged_acc_shape",
                           [("BATCH_AND_SIZE_INPUT", "BATCH_ACCUMULATED_ELEMENT_COUNT"),
                            ("BATCH_INPUT", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE")])
    results = run(backend, requests_of([(1, 2), (1, 4), (1, 1), (1, 3)]))
    for r in results:
        assert r["BATCH_AND_SIZE_OUTPUT"].tolist() == [[2, 6, 7, 10]]
        assert r["BATCH_OUTPUT"].shape == (1, 4)              # only the shape carries meaning


def test_batch_item_shape_flatten(tmp_path):
    backend = ragged_model(tmp_path, "batch_item_flatten",
                           [("BATCH_AND_SIZE_INPUT", "BATCH_ACCUMULATED_ELEMENT_COUNT"),
                            ("BATCH_INPUT", "BATCH_ITEM_SHAPE_FLATTEN")], dims="-1, -1")
    results = run(backend, requests_of([(1, 4, 1), (1, 1, 2), (1, 1, 2), (1, 2, 2)]))
    for r in results:
        assert r["BATCH_OUTPUT"].tolist() == [[4, 1, 1, 2, 1, 2, 2, 2]]


def test_batch_item_shape_per_batch_row(tmp_path):
    backend = model(
        tmp_path, "batch_item",
        'input { name: "RAGGED_INPUT" data_type: TYPE_FP32 dims: [ -1, -1 ] '
        'allow_ragged_batch: true } output { name: "BATCH_OUTPUT" data_type: TYPE_FP32 '
        f'dims: [ 2 ] }} {batch_inputs([("BATCH_INPUT", "BATCH_ITEM_SHAPE")])}',
        lambda p: save(p, [helper.make_node("Identity", ["BATCH_INPUT"], ["BATCH_OUTPUT"])],
                       [helper.make_tensor_value_info("RAGGED_INPUT", F, ["n"]),
                        helper.make_tensor_value_info("BATCH_INPUT", F, ["n", 2])],
                       [helper.make_tensor_value_info("BATCH_OUTPUT", F, ["r", 2])]))
    results = run(backend, requests_of([(2, 1, 2), (1, 1, 2), (1, 2, 2)],
                                       outputs=["BATCH_OUTPUT"]))
    assert [r["BATCH_OUTPUT"].tolist() for r in results] == [[[1, 2], [1, 2]], [[1, 2]],
                                                             [[2, 2]]]


def test_ragged_output_scattered_by_input_shape(tmp_path):
    backend = model(
        tmp_path, "ragged_io",
        'input { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } '
        'output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } '
        'batch_output { target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
        'source_input: "INPUT0" }',
        lambda p: identity_graph(p, "INPUT0", ["a"], "OUTPUT0", ["b"]))
    reqs = requests_of([(1, 2), (1, 4), (1, 1), (1, 3)], "INPUT0", ["OUTPUT0"])
    reqs[2].outputs = []                # not asked for: its elements are still skipped over
    results = run(backend, reqs)
    assert [r.get("OUTPUT0", np.zeros(0)).tolist() for r in results] == \
        [[[2, 2]], [[4, 4, 4, 4]], [], [[3, 3, 3]]]


@pytest.mark.parametrize("text,words", [
    ('batch_input { kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_FP32 '
     'source_input: "X" source_input: "X" }',
     "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 2 for m"),
    ('batch_input { kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_INT64 '
     'source_input: "X" }', "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    ('batch_input { kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_INT32 '
     'source_input: "Z" }', "unknown source input name 'Z' for m"),
    ('batch_output { target_name: "Q" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" }',
     "unknown target output name 'Q' for m"),
    ('batch_output { target_name: "Y" source_input: "X" } '
     'batch_output { target_name: "Y" source_input: "X" }',
     "target output name 'Y' can only be specified once for m"),
])
def test_bad_batch_io_is_refused_at_load_with_tritons_text(tmp_path, text, words):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(
        'name: "m" backend: "onnxruntime" max_batch_size: 4 input { name: "X" data_type: '
        'TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } output { name: "Y" data_type: '
        f'TYPE_FP32 dims: [ -1 ] }} {text}')
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "m")
    assert words in str(e.value)


def test_a_ragged_input_the_model_takes_in_two_dims_is_refused(tmp_path):
    with pytest.raises(Exception) as e:
        model(tmp_path, "two_d",
              'input { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: '
              'true } output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } '
              'batch_output { target_name: "OUTPUT0" source_input: "INPUT0" }',
              lambda p: identity_graph(p, "INPUT0", ["b", "n"], "OUTPUT0", ["b", "n"]))
    assert ("unable to load model 'two_d', configuration expects model provides input with "
            "shape [-1]  for ragged input 'INPUT0', model provides [-1,-1]") in str(e.value)


def test_example_ragged_mean_batches_a_burst_without_padding(triton_example):
    """The shipped example through tritonclient's asyncio HTTP client: 12 sequences of 1-12
    values at once; each gets its own mean and centred values whatever batch it ran in, and
    the burst ran in fewer executions than requests."""
    import tritonclient.http as httpclient
    import tritonclient.http.aio as aioclient

    base, client = triton_example
    rng = np.random.default_rng(0)
    seqs = [rng.normal(size=(1, n)).astype(np.float32) for n in range(1, 13)]

    def inputs(x):
        inp = aioclient.InferInput("VALUES", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return [inp]

    async def burst():
        c = aioclient.InferenceServerClient(base.removeprefix("http://"), conn_limit=12)
        try:
            return await asyncio.gather(*[c.infer("ragged_mean", inputs(x)) for x in seqs])
        finally:
            await c.close()

    before = client.get_inference_statistics("ragged_mean")["model_stats"][0]
    results = asyncio.run(burst())
    for x, r in zip(seqs, results):
        np.testing.assert_allclose(r.as_numpy("MEAN"), [[x.mean()]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r.as_numpy("CENTERED"), x - x.mean(), rtol=1e-5, atol=1e-5)
    after = client.get_inference_statistics("ragged_mean")["model_stats"][0]
    runs = after["execution_count"] - before["execution_count"]
    assert after["inference_count"] - before["inference_count"] == 12 and runs < 12
    bad = httpclient.InferInput("VALUES", [1, 3], "INT32")       # wrong datatype: 400
    bad.set_data_from_numpy(np.zeros((1, 3), np.int32))
    with pytest.raises(Exception, match="but model .ragged_mean. expects .FP32."):
        client.infer("ragged_mean", [bad])
    assert client.is_server_live()


@pytest.fixture(scope="module")
def triton_example(tmp_path_factory):
    """A Continuum v2 server over the example repository's ragged_mean."""
    import tritonclient.http as httpclient

    from examples.prepare_model_repository import DEFAULT_REPO, prepare
    from tests.v2_target import start_v2_server, stop_v2_server

    prepare()
    log = tmp_path_factory.mktemp("ragged") / "server.log"
    server = start_v2_server(DEFAULT_REPO, log, control_mode="explicit",
                             load_models=["ragged_mean"])
    client = httpclient.InferenceServerClient(server.http.removeprefix("http://"))
    yield server.http, client
    client.close()
    stop_v2_server(server)
