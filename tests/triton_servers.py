"""Two live v2 servers for the gRPC and shared-memory tests (one pair per test session; see
the `v2_servers` fixture in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from examples.prepare_model_repository import prepare
from tests.conftest import free_port, start_server

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


def repository(root: Path) -> Path:
    """simple, text_tokenizer, the test model under dynamic batching (`delayed`: 300 ms per
    execution, so concurrent requests queue and batch), and `repeat`, a decoupled model."""
    for name in ("simple", "text_tokenizer"):
        (root / name).symlink_to(EXAMPLES / name, target_is_directory=True)
    seq_model(root, "delayed", "dynamic_batching { max_queue_delay_microseconds: 100000 }", 300)
    (root / "repeat" / "1").mkdir(parents=True)
    (root / "repeat" / "1" / "model.py").symlink_to(ROOT / "tests/triton_models/repeat_model.py")
    (root / "repeat" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 0 model_transaction_policy { decoupled: true } '
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
        '{ name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]')
    return root


def start_v2_servers(tmp_path_factory):
    """Two live servers: `main` (client shared memory allowed, explicit model control) and
    `locked` (client shared memory off, model-repository and statistics RPCs restricted)."""
    prepare()
    repo = repository(tmp_path_factory.mktemp("grpc_repo"))
    out = {}
    procs = []
    for name, extra in (("main", ["--allow-client-shm", "--model-control-mode", "explicit",
                                  "--load-model", "*"]),
                        ("locked", ["--grpc-restricted-protocol",
                                    "model-repository,statistics:admin-key=s3cret"])):
        grpc_port = free_port()
        proc, base = start_server(["--no-llm", "--model-repository", str(repo),
                                   "--grpc-port", str(grpc_port), *extra,
                                   "--uvicorn-log-level", "warning"], "/v2/health/ready",
                                  repo.parent / f"{name}.log", timeout=120)
        procs.append(proc)
        out[name] = (base, f"127.0.0.1:{grpc_port}")
    return out, procs


