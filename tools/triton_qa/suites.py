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
