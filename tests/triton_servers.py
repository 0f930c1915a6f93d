"""Two live v2 servers for the gRPC, shared-memory, sequence and decoupled tests (one pair per
test session; see the `v2_servers` fixture in conftest.py): Continuum, or tritonserver 2.51
under `CONTINUUM_V2_TARGET=triton` (tests/v2_target.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

from examples.prepare_model_repository import prepare
from tests.v2_target import ON_TRITON, start_v2_server

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
SEQ = ('backend: "python" max_batch_size: 8 {batching} '
       'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
       'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
       '{ name: "EXEC" data_type: TYPE_INT64 dims: [ 1 ] }, '
       '{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ] '
       'parameters { key: "delay_ms" value { string_value: "{delay}" } }')


def seq_model(root: Path, name: str, batching: str, delay: int) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/seq_model.py")
    (root / name / "config.pbtxt").write_text(
        SEQ.replace("{batching}", batching).replace("{delay}", str(delay)))


SEQUENCE = """backend: "python" max_batch_size: {mbs}
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid} }} ] }}
  ]
  state [ {{ input_name: "ACC" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" }} }} ]
}}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "CTRL" data_type: TYPE_FP32 dims: [ 3 ] }},
         {{ name: "CORR" data_type: {corrid} dims: [ 1 ] }},
         {{ name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }} ]
parameters {{ key: "delay_ms" value {{ string_value: "{delay}" }} }}
"""

# name -> (strategy, CORRID type, max_batch_size, max_sequence_idle_microseconds, delay_ms)
SEQUENCE_MODELS = {
    "seq_direct": ("direct { }", "TYPE_UINT64", 4, 5_000_000, 60),
    "seq_oldest": ("oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 20000 }",
                   "TYPE_UINT64", 4, 5_000_000, 60),
    "seq_string": ("direct { }", "TYPE_STRING", 2, 5_000_000, 0),
    "seq_idle": ("direct { }", "TYPE_INT64", 1, 400_000, 0),
}


def sequence_model(root: Path, name: str) -> None:
    """A tests/triton_models/sequence_model.py model under the sequence batcher."""
    strategy, corrid, mbs, idle_us, delay = SEQUENCE_MODELS[name]
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").symlink_to(
        ROOT / "tests/triton_models/sequence_model.py")
    (root / name / "config.pbtxt").write_text(SEQUENCE.format(
        mbs=mbs, idle_us=idle_us, strategy=strategy, corrid=corrid, delay=delay))


TORCH_STATE = """backend: "pytorch" max_batch_size: 2
sequence_batching {
  direct { }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START
                                                int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "ACC" output_name: "ACC_OUT" data_type: TYPE_FP32 dims: [ 2 ]
            initial_state { data_type: TYPE_FP32 dims: [ 2 ] data_file: "start"
                            name: "from file" } } ]
}
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "ACC_OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def torch_state_model(root: Path) -> None:
    """`torch_state`: a TorchScript accumulator under the direct sequence batcher, its
    implicit state ACC starting from `initial_state/start` ([100, 200]): OUT = ACC + IN. Its
    arguments come in config order: IN, then the control input START, then the state ACC."""
    import numpy as np
    import torch

    class Accumulate(torch.nn.Module):
        def forward(self, x, start, acc):
            total = acc + x
            return total, total

    (root / "torch_state" / "1").mkdir(parents=True)
    with warnings.catch_warnings():        # TorchScript is deprecated; the backend serves it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Accumulate()).save(str(root / "torch_state" / "1" / "model.pt"))
    (root / "torch_state" / "initial_state").mkdir()
    np.array([100, 200], np.float32).tofile(root / "torch_state" / "initial_state" / "start")
    (root / "torch_state" / "config.pbtxt").write_text(TORCH_STATE)


def repository(root: Path) -> Path:
    """simple, text_tokenizer, the test model under dynamic batching (`delayed`: 300 ms per
    execution, so concurrent requests queue and batch; `cheap`: no delay, no queue delay), `repeat`, a decoupled model, the
    sequence models of SEQUENCE_MODELS, `iterative` (an iterative sequence model) with
    `not_iterative` (the same model without the sequence batcher), and `volume` (the test
    model with the volume-batching strategy: 12 bytes, 3 requests, per batch) and
    `torch_state` (TorchScript, implicit state from a data file)."""
    for name in ("simple", "text_tokenizer"):
        (root / name).symlink_to(EXAMPLES / name, target_is_directory=True)
    seq_model(root, "delayed", "dynamic_batching { max_queue_delay_microseconds: 100000 }", 300)
    seq_model(root, "cheap", "dynamic_batching { }", 0)
    (root / "repeat" / "1").mkdir(parents=True)
    (root / "repeat" / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/repeat_model.py")
    (root / "repeat" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 0 model_transaction_policy { decoupled: true } '
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
        '{ name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]')
    for name in SEQUENCE_MODELS:
        sequence_model(root, name)
    for name, batching in (("iterative", "sequence_batching { iterative_sequence: true }"),
                           ("not_iterative", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").symlink_to(
            ROOT / "tests/triton_models/iterative_model.py")
        (root / name / "config.pbtxt").write_text(
            'backend: "python" max_batch_size: 4 model_transaction_policy { decoupled: true } '
            f'{batching} input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ] '
            'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
            '{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ] '
            'parameters { key: "delay_ms" value { string_value: "30" } }')
    decoupled_ensembles(root)
    (root / "wrong_reschedule" / "1").mkdir(parents=True)
    (root / "wrong_reschedule" / "1" / "model.py").symlink_to(
        ROOT / "tests/triton_models/wrong_reschedule_model.py")
    (root / "wrong_reschedule" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 4 sequence_batching { iterative_sequence: true } '
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]')
    if not ON_TRITON:           # a Continuum batch strategy; a pytorch-backend model
        seq_model(root, "volume", "dynamic_batching { max_queue_delay_microseconds: 200000 } "
                  'parameters { key: "MAX_BATCH_VOLUME_BYTES" value { string_value: "12" } }',
                  100)
        (root / "volume" / "batch_strategy.py").symlink_to(
            ROOT / "examples/batch_strategies/volume_batching.py")
        torch_state_model(root)
    return root


REPEAT_IO = ('input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ] '
             'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
             '{ name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]')


def decoupled_ensembles(root: Path) -> None:
    """`double` (OUT = 2 * IN) and two ensembles over the decoupled `repeat`: `repeat_ens`
    (its one step) and `repeat_double` (repeat, then double on each of its responses)."""
    (root / "double" / "1").mkdir(parents=True)
    (root / "double" / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/double_model.py")
    (root / "double" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 0 input [ { name: "IN" data_type: TYPE_INT32 '
        'dims: [ 1 ] } ] output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]')
    repeat = ('{ model_name: "repeat" model_version: -1 input_map { key: "IN" value: "IN" } '
              'output_map { key: "OUT" value: "%s" } output_map { key: "IDX" value: "IDX" } }')
    double = ('{ model_name: "double" model_version: -1 input_map { key: "IN" value: "R" } '
              'output_map { key: "OUT" value: "OUT" } }')
    for name, steps in (("repeat_ens", repeat % "OUT"),
                        ("repeat_double", repeat % "R" + ", " + double)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            f'platform: "ensemble" max_batch_size: 0 {REPEAT_IO} '
            f'ensemble_scheduling {{ step [ {steps} ] }}')


def start_v2_servers(tmp_path_factory):
    """Two live servers: `main` (client shared memory allowed, explicit model control) and
    `locked` (client shared memory off, model-repository and statistics RPCs restricted).
    Returns ({name: (base URL, gRPC address)}, [V2Server])."""
    prepare()
    repo = repository(tmp_path_factory.mktemp("grpc_repo"))
    out, servers = {}, []
    for name, opts in (("main", dict(control_mode="explicit", load_models=["*"])),
                       ("locked", dict(allow_client_shm=False, grpc_restricted=[
                           "model-repository,statistics:admin-key=s3cret"]))):
        server = start_v2_server(repo, repo.parent / f"{name}.log", **opts)
        servers.append(server)
        out[name] = (server.http, server.grpc)
    return out, servers


