"""The qa suites run.py knows: where each runs in Triton's qa folder, how
(test.sh as it is, a slice of it, or a small driver doing what test.sh does
for one part), what it needs prepared, and what was left out.

Suite fields:
  qa_dir   folder under qa/ that is the working directory
  script   'test.sh' run as it is; or a script name plus `edits` / `cut_at`
           applied to a copy (test.qa_slice.sh, reported in the JSON); or
           None with `driver` (bash run after `source ../common/util.sh`)
  bash     bash options ('-x' as Triton's CI runs a top-level test.sh, '-ex'
           as L0_backend_python/test.sh runs its sub-suites)
  env      extra environment
  prepare  names of run.prepare_* steps
  timeout  seconds for the whole suite
  notes    what is left out and why
"""
from dataclasses import dataclass, field


@dataclass
class Suite:
    name: str
    qa_dir: str
    script: str | None = "test.sh"
    bash: str = "-x"
    args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    prepare: list = field(default_factory=list)
    edits: list = field(default_factory=list)      # (regex, replacement)
    cut_at: str | None = None                      # regex: drop this line and the rest
    driver: str | None = None
    timeout: int = 1800
    notes: str = ""


GENERATE_DRIVER = """
pip install sseclient-py
SERVER_ARGS="--model-repository=`pwd`/generate_models"
if [ -d ../python_models/generate_models ]; then  # Triton main moved the models
    SERVER_ARGS="--model-repository=`pwd`/../python_models/generate_models --log-verbose=1"
fi
SERVER_LOG="./inference_server_generate_endpoint_test.log"
CLIENT_LOG="./generate_endpoint_test.log"
run_server
if [ "$SERVER_PID" == "0" ]; then echo "*** Failed to start $SERVER"; cat $SERVER_LOG; exit 1; fi
python generate_endpoint_test.py >$CLIENT_LOG 2>&1
RC=$?
cat $CLIENT_LOG
kill $SERVER_PID
wait $SERVER_PID
exit $RC
"""

BACKEND_PYTHON_SUBS = {
    "bls": "libtorch_gpu / libtorch_cpu / onnx_nobatch_sequence_int32 / "
           "onnx_int32_int32_int32 (BLS targets) are placeholders, not served: the "
           "model's internal unittest cases that call them fail on both servers. GPU "
           "tensor / CUDA memory pool checks cannot pass without a GPU. The script's "
           "grep checks of the server log (\"Request timeout: 11000000000\", BLS error "
           "messages) are Triton log lines.",
    "async_execute": "",
    "decoupled": "dlpack_add_sub GPU paths need CUDA; the script greps the server log "
                 "for the models' pb_utils.Logger lines and 'Finalize invoked'.",
    "io": "test_variable_gpu_output / test_empty_gpu_output ask for GPU tensors.",
    "request_rescheduling": "",
    "response_sender": "",
    "parameters": "only in Triton's main branch (not at v2.51.0): run it from a main "
                  "checkout; tritonserver 2.51's python backend predates response "
                  "parameters.",
}


def backend_python_sub(sub, notes):
    return Suite(
        name=f"L0_backend_python/{sub}", qa_dir=f"L0_backend_python/{sub}", bash="-ex",
        env={"MODELDIR": "{qa}/L0_backend_python"}, prepare=["datadir"], timeout=2400,
        notes="pip / pip3 are no-ops (deps are in the venvs). " + notes)


SUITES = {
    "L0_http/generate_endpoint": Suite(
        name="L0_http/generate_endpoint", qa_dir="L0_http", script=None,
        driver=GENERATE_DRIVER, timeout=900,
        notes="Only the generate-endpoint part of L0_http/test.sh (its other parts "
              "need TF/ONNX/plan qa_model_repository models, nginx, basic auth). The "
              "driver does what that part of test.sh does (main keeps the models in "
              "qa/python_models/generate_models and adds --log-verbose=1). v2.51.0 has "
              "17 tests, main 18 (use a main checkout)."),
    "L0_backend_python": Suite(
        name="L0_backend_python", qa_dir="L0_backend_python", script="test.sh",
        env={"PYTHON_ENV_VERSION": "10"}, prepare=["datadir"], timeout=1800,
        edits=[(r'python3 --version \| grep "3\.(10|\$\{PYTHON_ENV_VERSION\})" > /dev/null',
                "true  # qa slice: python version check dropped (3.11 here)"),
               (r'(# Test KIND_GPU\n.*\n)if \[ "\$TEST_JETSON" == "0" \] && \[\[ \$\{TEST_WINDOWS\} == 0 \]\]; then',
                r'\1if false; then  # qa slice: no GPU here for the KIND_GPU model')],
        cut_at=r"^# Disable env test for Jetson since cloud storage",
        notes="test.sh up to its sub-suite loops (python_test.py plus the script's own "
              "server start / kill -9 / multi_file / model_env / shm size / init_exit "
              "checks); the sub-suites run as their own suites. Python 3.10 checks "
              "dropped (3.11 here); the KIND_GPU (add_sub_gpu) server start is skipped "
              "(no GPU; it would end the script); pip is a no-op. CUDA shared memory "
              "cases need a GPU."),
    "L0_decoupled": Suite(
        name="L0_decoupled", qa_dir="L0_decoupled", script="test.sh",
        args=["24.10"], prepare=["decoupled_python_models"], timeout=1500,
        edits=[(r'^TRIALS="python custom"', 'TRIALS="python"  # qa slice: python trial only')],
        cut_at=r"^NON_DECOUPLED_DIR=",
        notes="Python trial only: the 'custom' trial and the non-decoupled run use the "
              "C++ repeat/square/identity backends. python_models is built as "
              "Dockerfile.QA does (ensembles from models/ + python_backend's "
              "examples/decoupled repeat and square), except that the example model "
              "file is named 1/model.py (Dockerfile.QA keeps repeat_model.py). "
              "identity_int32 (C++ identity backend) and the ensembles using it "
              "are not served; libtorch_nobatch_int32_int32_int32 is absent."),
    "L0_sequence_batcher": Suite(
        name="L0_sequence_batcher", qa_dir="L0_sequence_batcher", script="test.sh",
        args=["24.10"], env={"BACKENDS": "python", "ENSEMBLES": "0"},
        prepare=["datadir", "sequence_datadir"], timeout=7200,
        notes="BACKENDS=python ENSEMBLES=0 (the ensembles use C++ nop models). The "
              "python models are built by test.sh from the ONNX configs that the "
              "checkout's gen_qa_sequence_models.py writes (KIND_GPU -> KIND_CPU). "
              "SequenceBatcherRequestTimeoutTest uses a C++ custom model (not served). "
              "MODEL_TRIALS may be narrowed with --env MODEL_TRIALS='0 v'."),
}
for _sub, _notes in BACKEND_PYTHON_SUBS.items():
    SUITES[f"L0_backend_python/{_sub}"] = backend_python_sub(_sub, _notes)


# ---- L0_http / L0_grpc / L0_logging / L0_trace: test.sh with edits --------

SLICE_PRELUDE = ("rm -f *.log\nrm -f *.log.*\nsource ../common/util.sh\nset -e\n"
                 "# triton_qa slice: the parts before this need TF / C++ models, C++ clients, nginx\n")


def skip_to(first, marker, text=SLICE_PRELUDE):
    """An edit dropping the lines from `first` up to (not including) `marker`."""
    return (rf"(?s)^{first}.*?(?=^{marker})", text)


PY_CLIENTS = [  # no C++ clients here: the python examples of the same name (qa/clients)
    (r"^SIMPLE_HTTP_CLIENT=\.\./clients/simple_http_infer_client$",
     'SIMPLE_HTTP_CLIENT="python ../clients/simple_http_infer_client.py"  # triton_qa: python client'),
    (r"^SIMPLE_GRPC_CLIENT=\.\./clients/simple_grpc_infer_client$",
     'SIMPLE_GRPC_CLIENT="python ../clients/simple_grpc_infer_client.py"  # triton_qa: python client'),
    (r"^DATADIR=/data/inferenceserver/\$\{REPO_VERSION\}/qa_model_repository$",
     "DATADIR=$DATADIR/qa_model_repository  # triton_qa: the run's DATADIR"),
]
TEST_SH_SUITES = {
    "L0_http": Suite(
        name="L0_http", qa_dir="L0_http", args=["24.10"], timeout=1500,
        prepare=["simple_model", "identity_datadir"],
        edits=[skip_to(r"# Add string_dyna_sequence model to repo", r"# Run python http aio unit test")],
        notes="test.sh from the python aio test on: python_http_aio_test.py (models/simple: "
              "python twin of the TF `simple`), http_test.py (qa_identity_model_repository's "
              "onnx_zero_* as python identity models), generate_endpoint_test.py (also its own "
              "suite), the restricted-API start checks and http_restricted_api_test.py. Left "
              "out (the part before): C++ clients, cc_client_test, TF image / string / sequence "
              "models, the custom dyna_sequence backend, nginx basic auth."),
    "L0_grpc": Suite(
        name="L0_grpc", qa_dir="L0_grpc", args=["24.10"], timeout=1500,
        prepare=["simple_model"],
        edits=[skip_to(r"# Add string_dyna_sequence model to repo", r"# Run python grpc aio unit test"),
               skip_to(r"# Test GRPC health check implemented", r"# Repeated protocol, not allowed",
                       "# triton_qa slice: grpc-health-probe needs `go install` (no internet)\n")],
        notes="test.sh from the python aio test on: python_grpc_aio_test.py (models/simple: "
              "python twin of the TF `simple`), the restricted-protocol start checks and "
              "python_unit_test.py RestrictedProtocolTest. Left out: grpc-health-probe (go "
              "install from the internet) and the part before (C++ clients, cc_client_test, "
              "TF models, custom backends, client plugin, nginx basic auth)."),
    "L0_logging": Suite(
        name="L0_logging", qa_dir="L0_logging", args=["24.10"], timeout=1500,
        prepare=["qa_clients", "python_int32_datadir"], edits=PY_CLIENTS,
        notes="test.sh whole: `simple` is the python twin of onnx_int32_int32_int32; the C++ "
              "simple_http/grpc_infer_client are replaced by the python examples of the same "
              "name; DATADIR (hard-coded /data/inferenceserver/...) points at the run's."),
    "L0_trace": Suite(
        name="L0_trace", qa_dir="L0_trace", args=["24.10"], timeout=1800,
        prepare=["qa_clients", "python_int32_datadir"], edits=PY_CLIENTS,
        cut_at=r"^# Custom backend tracing",
        notes="test.sh up to the custom-backend tracing part: trace API checks, trace files "
              "checked with trace_summary.py, trace_endpoint_test.py, --trace-config, the BLS "
              "/ ensemble trace, explicit-mode load/unload. `simple` / `global_simple` are the "
              "python twin of onnx_int32_int32_int32, the ensemble is the checkout's generated "
              "one over it; C++ clients -> python examples. Left out: custom backend tracing "
              "(C++ identity backend), opentelemetry_unittest.py and the OTel parts (they "
              "download otelcol from GitHub; no internet here), SageMaker."),
    "L0_batch_input": Suite(
        name="L0_batch_input", qa_dir="L0_batch_input", args=["24.10"], timeout=1200,
        env={"BACKENDS": "onnx", "QA_PYTHON_ONLY": "0"}, prepare=["onnx_ragged_datadir"],
        edits=[(r"^DATADIR=/data/inferenceserver/\$\{REPO_VERSION\}/qa_ragged_model_repository$",
                "DATADIR=$DATADIR/qa_ragged_model_repository  # triton_qa: the run's DATADIR"),
               (r"^IDENTITY_DATADIR=/data/inferenceserver/\$\{REPO_VERSION\}/qa_identity_model_repository$",
                "IDENTITY_DATADIR=${DATADIR%/qa_ragged_model_repository}/qa_identity_model_repository"
                "  # triton_qa: the run's DATADIR")],
        notes="BACKENDS=onnx (the script honours it); the ONNX models are the checkout's "
              "generators' (KIND_GPU -> KIND_CPU); the repository is served unfiltered "
              "(QA_PYTHON_ONLY=0). Continuum only: tritonserver from nvidia-pytriton has no "
              "onnxruntime backend (and savedmodel / plan / libtorch need TF, TensorRT, "
              "libtorch backends neither server has here)."),
}
SUITES.update(TEST_SH_SUITES)
