"""The GPU check (benchmarks/device_check.py) runs end to end here in its `--smoke` mode: the tiny
random-weight config on the CPU, the Triton attention backend under Triton's interpreter, float32,
no CUDA graphs. Its JSON must hold every section, with exact greedy parity against transformers
(including a prefix-cache hit and a chunked prompt) — so that the one run on a GPU does not fail
on a typo. What only a GPU shows (graphs, bfloat16 kernels, timings) is not checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device_check

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("env", "attention_kernel", "checkpoints", "parity", "decode_step", "throughput", "goals", "wall_s")


def test_device_command_is_printed_and_documented():
    done = subprocess.run([sys.executable, "benchmarks/device_check.py", "--print-command"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == device_check.COMMAND
    assert device_check.COMMAND in device_check.__doc__


@pytest.mark.extended
def test_smoke_run_writes_every_section(model_dir, tmp_path):
    pytest.importorskip("triton", reason="the triton package is not installed")
    out = tmp_path / "device_check.json"
    done = subprocess.run([sys.executable, "benchmarks/device_check.py", "--smoke",
                           "--base-dir", str(model_dir), "--out", str(out),
                           "--work-dir", str(tmp_path / "checkpoints")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "smoke" and data["skipped"] == []
    for name in SECTIONS:
        assert isinstance(data[name], dict) and "error" not in data[name], (name, data[name])

    runs = data["parity"]["tiny"]["float32"]
    assert runs["graphs"] == "graphs: unavailable on cpu"
    eager = runs["eager"]
    assert eager["attention_backend"] == "triton"
    assert eager["counts"] == {"exact": 9, "near-tie": 0, "mismatch": 0}, eager["checks"]
    assert eager["prefix_cache_hits"]["cached_prefix"] > 0
    assert eager["prefix_cache_hits"]["concurrent"] > 0
    assert data["parity"]["tiny"]["prompt_lens"]["long"] > device_check.SMOKE.chunk_budget

    step = data["decode_step"]
    assert step["graphs"] == "graphs: unavailable on cpu"
    assert all(step["eager"][str(b)]["median_ms"] > 0 for b in device_check.SMOKE.batch_sizes)
    tput = data["throughput"]
    assert tput["continuum"]["output_tokens"] == 4 * 8
    assert isinstance(tput["transformers_generate_batch"], dict)   # its result, or its error
    assert data["goals"]["parity"]["pass"] is True
    kernel = data["attention_kernel"]                     # split-KV vs one-pass: they agree
    assert all(kernel[c]["max_abs_diff"] < 1e-5 for c in ("16", "64")), kernel


@pytest.mark.extended
def test_profile_smoke_run_reports_steps_and_kernels(model_dir, tmp_path):
    """benchmarks/device_profile.py (the batch-1 step's breakdown on a GPU) runs end to end here
    in its smoke mode and writes the step time, the host profile and the op table."""
    pytest.importorskip("triton", reason="the triton package is not installed")
    out = tmp_path / "profile.txt"
    done = subprocess.run([sys.executable, "benchmarks/device_profile.py", "--smoke",
                           "--base-dir", str(model_dir), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    text = out.read_text()
    assert "step: median" in text and "cProfile of 5 steps" in text
    assert "function calls" in text and "torch.profiler of 2 steps" in text


@pytest.mark.extended
def test_device_ab_smoke_times_two_trees(model_dir, tmp_path):
    """benchmarks/device_ab.py, the GPU session's A/B of two trees, in its CPU mode: every
    round holds both trees' step medians and the summary their ratio."""
    out = tmp_path / "device_ab.json"
    done = subprocess.run([sys.executable, "benchmarks/device_ab.py", "--smoke",
                           "--base-dir", str(model_dir), "--tree", f"a={ROOT}",
                           "--tree", f"b={ROOT}", "--batches", "1,2", "--steps", "3",
                           "--rounds", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["errors"] == [] and len(data["rounds"]) == 2
    for batch in ("1", "2"):
        assert all(r[t][batch]["median_ms"] > 0 for r in data["rounds"] for t in ("a", "b"))
        assert data["summary"][batch]["speedup_vs_a"]["b"] > 0
