"""`continuum serve`'s refusal of a bad flag: one line, exit 2, before the heavy imports.

A flag that can be checked without the model or the device (numbers, combinations, the
restricted-API and trace specs, `--speculative-config`, LoRA modules) is refused before torch
or FastAPI load (~0.2 s, not ~2 s); a check that needs the device (`--dtype` on this CPU) loads
torch and still answers in one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent

# Runs the CLI in this interpreter and prints which heavy modules were loaded when it exited.
PROBE = """
import sys
from api.cli import main
try:
    main(sys.argv[1:])
finally:
    print("loaded:", sorted(m for m in ("torch", "fastapi", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("flags,words", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory"),
    (["--lora-modules", "nopath"], "expected NAME=PATH"),
    (["--api-server-count", "2", "--metrics-port", "9400"], "cannot be used with --metrics-port"),
    (["--grpc-port", "9000", "--port", "9000"], "--grpc-port 9000 is also --port"),
    (["--speculative-config", '{"k": 3}'], "unknown key 'k'"),
])
def test_bad_flag_is_refused_before_torch_loads(flags, words):
    r = subprocess.run([sys.executable, "-c", PROBE, "serve", *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("continuum: error:") and words in lines[0], \
        r.stderr
    assert "loaded: []" in r.stdout, r.stdout


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a GPU is here: --device cuda starts")
def test_a_device_check_loads_torch_and_still_answers_in_one_line():
    # A free --port: the default 8000 may be held by a server the user runs beside the tests.
    r = subprocess.run([sys.executable, "-m", "api", "serve", "--device", "cuda",
                        "--port", str(free_port())], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("continuum: error:") and "cuda" in lines[0], \
        r.stderr
