"""Preparation steps of run.py (suites.py `prepare`): what Triton's CI image
holds and the checkout does not, laid out in the run's scratch folder.

Each `prepare_<name>(work, args, suite)` step writes under `work` (the scratch
folder; `work/qa` is the copy of the checkout's qa/, `work/data` the DATADIR).
The python stand-ins for ONNX / TensorFlow models are Triton's own files (the
python_backend add_sub example, qa/python_models configs) except the identity
model, `models/identity_model.py` of this folder (see there).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.realpath(__file__))

PLACEHOLDERS = {  # DATADIR models that test.sh copies but no server here can run
    "qa_model_repository/libtorch_nobatch_float32_float32_float32": "pytorch_libtorch",
    "qa_model_repository/libtorch_nobatch_int32_int32_int32": "pytorch_libtorch",
    "qa_model_repository/onnx_int32_int32_int32": "onnxruntime_onnx",
    "qa_sequence_implicit_model_repository/onnx_nobatch_sequence_int32": "onnxruntime_onnx",
}


def prepare_datadir(work, args, suite):
    for rel, platform in PLACEHOLDERS.items():
        path = os.path.join(work, "data", rel)
        os.makedirs(os.path.join(path, "1"), exist_ok=True)
        with open(os.path.join(path, "config.pbtxt"), "w") as f:
            f.write(f'name: "{os.path.basename(rel)}"\nplatform: "{platform}"\n'
                    "# triton_qa placeholder: no such backend here, not served\n")


def prepare_sequence_datadir(work, args, suite):
    """ONNX sequence models from the checkout's generator; test.sh derives the python ones."""
    gen = os.path.join(work, "qa", "common", "gen_qa_sequence_models.py")
    py = os.path.join(args.client_venv, "bin", "python")
    for repo, extra in (("qa_sequence_model_repository", []),
                        ("qa_variable_sequence_model_repository", ["--variable"])):
        dest = os.path.join(work, "data", repo)
        subprocess.check_call([py, gen, "--onnx", f"--models_dir={dest}"] + extra,
                              cwd=os.path.dirname(gen), stdout=subprocess.DEVNULL)
        gpu_to_cpu(dest)


def gpu_to_cpu(root):
    """No GPU here: instance groups of the generated configs become KIND_CPU."""
    for folder, _, files in os.walk(root):
        if "config.pbtxt" in files:
            path = os.path.join(folder, "config.pbtxt")
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace("KIND_GPU", "KIND_CPU"))


def prepare_decoupled_python_models(work, args, suite):
    """As Dockerfile.QA: python_models = models + src/test/models/{repeat,square}_int32
    + python_backend's examples/decoupled (model file named model.py here)."""
    qa_dec = os.path.join(work, "qa", "L0_decoupled")
    src_models = os.path.join(args.triton_checkout, "src", "test", "models")
    if not os.path.isdir(src_models):
        sys.exit(f"{src_models} missing: L0_decoupled needs src/test/models of the checkout")
    for name in ("repeat_int32", "square_int32"):
        shutil.copytree(os.path.join(src_models, name), os.path.join(qa_dec, "models", name),
                        dirs_exist_ok=True)
    for name in os.listdir(os.path.join(qa_dec, "models")):
        os.makedirs(os.path.join(qa_dec, "models", name, "1"), exist_ok=True)
    py_models = os.path.join(qa_dec, "python_models")
    shutil.copytree(os.path.join(qa_dec, "models"), py_models)
    examples = git_files(args, "examples/decoupled")
    for name in ("repeat", "square"):
        model = os.path.join(py_models, f"{name}_int32")
        with open(os.path.join(model, "1", "model.py"), "wb") as f:
            f.write(examples[f"{name}_model.py"])
        with open(os.path.join(model, "config.pbtxt"), "wb") as f:
            f.write(examples[f"{name}_config.pbtxt"])


def git_files(args, folder):
    """{basename: bytes} of python_backend's folder at --python-backend-tag."""
    return git_show(args.python_backend_git, args.python_backend_tag, folder)


def git_show(git_dir, ref, folder):
    """{basename: bytes} of the files directly in `folder` of a bare repo at `ref`."""
    git = ["git", f"--git-dir={git_dir}"]
    names = subprocess.check_output(git + ["ls-tree", "--name-only", ref, folder + "/"]).decode().split()
    return {os.path.basename(n): subprocess.check_output(git + ["show", f"{ref}:{n}"]) for n in names}


def prepare_qa_clients(work, args, suite):
    """qa/clients: the python examples of Triton's client repo (Dockerfile.QA copies
    them there), so that test.sh's ../clients/simple_*_client.py exist."""
    dest = os.path.join(work, "qa", "clients")
    os.makedirs(dest, exist_ok=True)
    files = git_show(args.client_git, args.client_tag, "src/python/examples")
    for name, data in files.items():
        if name.endswith(".py"):
            with open(os.path.join(dest, name), "wb") as f:
                f.write(data)


def write_simple_model(args, dest, name, versions=(1,)):
    """A python twin of Triton's TF `simple` model (INT32 [16] INPUT0 / INPUT1, max batch 8;
    OUTPUT0 = sum, OUTPUT1 = difference): the config of qa/python_models/execute_delayed_model
    (named `simple`, which L0_shared_memory uses as its python `simple`) with python_backend's
    examples/add_sub/model.py (the same model without the 15 s sleep)."""
    with open(os.path.join(args.triton_checkout, "qa", "python_models", "execute_delayed_model",
                           "config.pbtxt")) as f:
        config = re.sub(r'^name:.*$', f'name: "{name}"', f.read(), flags=re.M)
    model = git_show(args.python_backend_git, args.python_backend_tag, "examples/add_sub")["model.py"]
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "config.pbtxt"), "w") as f:
        f.write(config)
    for version in versions:
        os.makedirs(os.path.join(dest, str(version)), exist_ok=True)
        with open(os.path.join(dest, str(version), "model.py"), "wb") as f:
            f.write(model)


def prepare_simple_model(work, args, suite):
    """<suite folder>/models/simple, which Dockerfile.QA copies from the TF examples."""
    write_simple_model(args, os.path.join(work, "qa", suite.qa_dir, "models", "simple"), "simple")


def prepare_python_int32_datadir(work, args, suite):
    """DATADIR/qa_model_repository/onnx_int32_int32_int32 (versions 1-3) as the python twin
    of `simple` (same inputs, outputs and sum / difference; L0_logging and L0_trace rename
    it `simple`), and the ensemble over it that L0_trace copies
    (qa_ensemble_model_repository/.../simple_onnx_int32_int32_int32, as the checkout's
    gen_qa_models.py --ensemble writes it)."""
    write_simple_model(args, os.path.join(work, "data", "qa_model_repository",
                                          "onnx_int32_int32_int32"),
                       "onnx_int32_int32_int32", versions=(1, 2, 3))
    gen = os.path.join(work, "qa", "common", "gen_qa_models.py")
    py = os.path.join(args.client_venv, "bin", "python")
    dest = os.path.join(work, "data", "qa_ensemble_model_repository", "qa_model_repository")
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(work, "tmp")) as tmp:
        subprocess.check_call([py, gen, "--ensemble", f"--models_dir={tmp}"],
                              cwd=os.path.dirname(gen), stdout=subprocess.DEVNULL)
        shutil.copytree(os.path.join(tmp, "simple_onnx_int32_int32_int32"),
                        os.path.join(dest, "simple_onnx_int32_int32_int32"))


IDENTITY_MODELS = ("onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16",
                   "onnx_zero_3_float32")


def prepare_identity_datadir(work, args, suite):
    """DATADIR/qa_identity_model_repository/onnx_zero_* (http_test.py's models) as python
    models: the configs the checkout's gen_qa_identity_models.py --onnx writes, backend
    python instead of onnxruntime_onnx, and models/identity_model.py (OUTPUTi = INPUTi)."""
    gen = os.path.join(work, "qa", "common", "gen_qa_identity_models.py")
    py = os.path.join(args.client_venv, "bin", "python")
    dest = os.path.join(work, "data", "qa_identity_model_repository")
    with tempfile.TemporaryDirectory(dir=os.path.join(work, "tmp")) as tmp:
        subprocess.check_call([py, gen, "--onnx", f"--models_dir={tmp}"],
                              cwd=os.path.dirname(gen), stdout=subprocess.DEVNULL)
        for name in IDENTITY_MODELS:
            with open(os.path.join(tmp, name, "config.pbtxt")) as f:
                config = f.read().replace('platform: "onnxruntime_onnx"', 'backend: "python"')
            os.makedirs(os.path.join(dest, name, "1"), exist_ok=True)
            with open(os.path.join(dest, name, "config.pbtxt"), "w") as f:
                f.write(config)
            shutil.copy(os.path.join(HERE, "models", "identity_model.py"),
                        os.path.join(dest, name, "1", "model.py"))


def prepare_onnx_ragged_datadir(work, args, suite):
    """L0_batch_input's ONNX models, written by the checkout's generators into DATADIR:
    qa_ragged_model_repository (gen_qa_ragged_models.py --onnx: onnx_batch_input,
    onnx_batch_item) and qa_identity_model_repository (gen_qa_identity_models.py --onnx:
    onnx_nobatch_zero_1_float32, which test.sh turns into ragged_io); KIND_GPU -> KIND_CPU.
    Only Continuum has an onnxruntime backend here."""
    py = os.path.join(args.client_venv, "bin", "python")
    common = os.path.join(work, "qa", "common")
    for gen, repo in (("gen_qa_ragged_models.py", "qa_ragged_model_repository"),
                      ("gen_qa_identity_models.py", "qa_identity_model_repository")):
        dest = os.path.join(work, "data", repo)
        subprocess.check_call([py, os.path.join(common, gen), "--onnx", f"--models_dir={dest}"],
                              cwd=common, stdout=subprocess.DEVNULL)
        gpu_to_cpu(dest)
