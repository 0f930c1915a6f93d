"""AMX tiles (issue 51) where Linux refuses them: the quantized linears fall back to AVX-512
with one log line, compute the same products, and a served model answers — never SIGILL (a
tile instruction without the permission is one; llama.cpp's AMX build dies of it on such
hosts). The refusal is forced by a seccomp filter (tests/refuse_amx.py). The tile kernels'
numerics: tests/test_quant.py::test_amx_tiles_match_gguf_py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels.isa import cpu_isa

# cpu_isa: the host's level, or CONTINUUM_CPU_ISA's where lower (a capped run never asks Linux
# for the tiles, so there is no refusal to fall back from)
pytestmark = pytest.mark.skipif(cpu_isa() != "amx", reason="needs an AMX host (amx_tile, "
                                "amx_bf16, avx512_bf16) not capped by CONTINUUM_CPU_ISA")
ROOT = Path(__file__).resolve().parents[1]

KERNELS = """
import sys
sys.path[:0] = ["tests", "."]
import refuse_amx
refuse_amx.install()
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
import torch
from engine import kernels
from test_quant import random_blocks, reference
lib = kernels.load()
print("amx_rows", lib.amx_rows, flush=True)
w = random_blocks("Q4_1", 70, 256)
x = torch.randn(64, 256).bfloat16()
want = x.double() @ reference(w).float().bfloat16().double().T
err = (lib.quant_linear(x, w, None, torch.float32).double() - want).abs().max()
print("relative error", float(err / want.abs().max()), flush=True)
"""


def test_refused_tiles_fall_back_to_avx512_with_one_line():
    out = subprocess.run([sys.executable, "-c", KERNELS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "amx_rows 0" in log
    assert log.count("AMX tiles refused by Linux") == 1, log
    assert "Operation not permitted" in log
    err = float(log.split("relative error")[1].split()[0])
    assert err < 1e-5


def test_a_server_refused_tiles_serves_and_says_so(tmp_path):
    """`continuum serve` (the default configuration) under the refusal: ready, its log names
    the refusal, a chat completion over the OpenAI SDK answers, the server stays up."""
    from openai import OpenAI

    from tests.conftest import start_server, stop_server
    log = tmp_path / "server.log"
    proc, base = start_server(["--max-model-len", "512", "--kv-cache-memory", "0.1"],
                              "/health/ready", log, launcher=["tests/refuse_amx.py", "api"])
    try:
        text = log.read_text()
        assert "tiles refused" in text and "AMX tiles refused by Linux" in text
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
        assert client.models.list().data                            # still up
        assert proc.poll() is None
    finally:
        stop_server(proc)
