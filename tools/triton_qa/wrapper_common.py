"""Shared by the two server wrappers: tritonserver flag parsing and the
python-only model-repository filter.

tritonserver takes `--flag=value` and `--flag value`; `parse_flags` turns the
argument list into (name, value) pairs, value None for a bare flag.

QA_PYTHON_ONLY=1 (set by run.py) makes `python_only_repository` serve a
filtered view of a model repository: a temporary folder of symlinks to the
model folders whose config.pbtxt names the python backend, plus ensembles
whose steps all survive. The qa scripts copy ONNX / libtorch / custom C++
models that no server here can run; both wrappers drop them the same way, so
both servers see the same repository. What is dropped is printed.
"""
import os
import re
import sys
import tempfile

# tritonserver flags that never take a value (bare switches).
BARE_FLAGS = {"--help", "--version"}


def log(tag, msg):
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def parse_flags(argv):
    """['--a=1', '--b', '2', '--c'] -> [('--a', '1'), ('--b', '2'), ('--c', None)]."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if "=" in arg and arg.startswith("--"):
            name, value = arg.split("=", 1)
        elif arg in BARE_FLAGS or i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            name, value = arg, None
        else:
            name, value = arg, argv[i + 1]
            i += 1
        out.append((name, value))
        i += 1
    return out


def _config_text(model_dir):
    path = os.path.join(model_dir, "config.pbtxt")
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _model_kind(text):
    """'python', 'ensemble', or the other backend / platform named."""
    m = re.search(r'^\s*backend\s*:\s*"([^"]*)"', text, re.M)
    if m:
        return m.group(1)
    m = re.search(r'^\s*platform\s*:\s*"([^"]*)"', text, re.M)
    return m.group(1) if m else "unknown"


def _ensemble_steps(text):
    return set(re.findall(r'model_name\s*:\s*"([^"]*)"', text))


def _select(repo):
    """Model names to keep, and {dropped name: reason}."""
    kinds, texts = {}, {}
    for name in sorted(os.listdir(repo)):
        path = os.path.join(repo, name)
        if os.path.isdir(path):
            texts[name] = _config_text(path)
            kinds[name] = _model_kind(texts[name])
    keep = {n for n, k in kinds.items() if k in ("python", "ensemble")}
    dropped = {n: f"backend/platform '{k}'" for n, k in kinds.items() if n not in keep}
    changed = True
    while changed:  # ensembles need every step model
        changed = False
        for n in sorted(keep):
            missing = _ensemble_steps(texts[n]) - keep if kinds[n] == "ensemble" else set()
            if missing:
                keep.discard(n)
                dropped[n] = f"ensemble step(s) {sorted(missing)} not served"
                changed = True
    return keep, dropped


def python_only_repository(repo, tag):
    """`repo`, or a temp folder of symlinks to its python (and ensemble) models."""
    if os.environ.get("QA_PYTHON_ONLY") != "1" or not os.path.isdir(repo):
        return repo
    keep, dropped = _select(repo)
    if not dropped:
        return repo
    view = tempfile.mkdtemp(prefix="qa_repo_view_", dir=os.environ.get("QA_TMP") or None)
    for name in keep:
        os.symlink(os.path.join(os.path.abspath(repo), name), os.path.join(view, name))
    for name, why in sorted(dropped.items()):
        log(tag, f"QA_PYTHON_ONLY: not serving model '{name}' ({why})")
    log(tag, f"QA_PYTHON_ONLY: serving {repo} through {view}")
    return view
