"""The SLO options as a user runs them: `continuum serve --tuning-profile low_latency` (sjf,
`--target-itl-ms auto`, `--preemption-mode auto`) on a KV pool small enough to preempt, driven
by the OpenAI SDK; its metrics; and one-line start errors for bad values."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import KEY, MODEL, greedy, metric, start_server, stop_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def slo_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("slo") / "server.log"
    proc, base = start_server(["--tuning-profile", "low_latency", "--num-gpu-blocks-override",
                               "48", "--max-model-len", "768", "--swap-space", "0.25"],
                              "/health/ready", log)
    yield base, log
    stop_server(proc)


@pytest.mark.extended          # its own server (~19 s); the engine's SLO tests stay
def test_low_latency_profile_streams_preempts_by_cost_and_budgets_prefill(slo_server, server):
    from openai import OpenAI

    base, log = slo_server
    text = log.read_text()
    assert "--target-itl-ms auto: unloaded decode step" in text
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    story = "Tell me a long story about a lighthouse keeper and the sea. " * 20

    def stream(i: int) -> int:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{i}. {story}"}],
            max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})
        return [c.usage.completion_tokens for c in chunks if c.usage][0]

    # Each request needs 293 + 300 tokens = 38 blocks of 16; two need 76 > 48. The target may
    # hold the second prompt back, but for at most patience + ceil(293 / 32) + 1 = 266 steps,
    # fewer than the first request's 300 decode steps, so the two overlap and one is preempted
    # on any host, however slow or noisy.
    budgets, streaming = [], threading.Event()

    def watch_budget() -> None:         # read while the streams run: idle, it is full again
        while not streaming.is_set():
            budgets.append(metric(base, "continuum_prefill_budget_tokens"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_budget)
    watcher.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            counts = list(pool.map(stream, range(2)))
    finally:
        streaming.set()
        watcher.join()
    assert counts == [300, 300], counts
    body = httpx.get(f"{base}/metrics", timeout=5).text
    by_mode = {mode: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               for mode in ("swap", "recompute")
               if line.startswith("continuum_preemptions_by_mode_total")
               and f'mode="{mode}"' in line}
    assert sum(by_mode.values()) == metric(base, "continuum_num_preemptions_total") > 0
    # The budget adapts while they run: below the fixed 2048 (under the 32-token floor while
    # no prefill has waited its patience, 256 steps); when the engine idles it is full again.
    assert budgets and 0 <= min(budgets) < 2048, budgets
    assert greedy(base) == greedy(server, KEY)     # same tokens as the default server


@pytest.mark.parametrize("flags,words", [     # ~0.2 s a refusal (no torch loaded)
    (["--target-itl-ms", "-5"], "--target-itl-ms must be a positive number"),
    (["--target-itl-ms", "20", "--no-enable-chunked-prefill"], "needs chunked prefill"),
    (["--tuning-profile", "low_latency", "--no-enable-chunked-prefill"],
     "needs chunked"),
])
def test_bad_slo_flags_are_one_line_errors(flags, words):
    r = subprocess.run([sys.executable, "-m", "api", "serve", *flags, "--port", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("continuum: error:"), r.stderr
    assert words in lines[0]


def test_tuning_profile_defaults_yield_to_explicit_flags():
    from api.cli import build_parser
    from api.serve_config import engine_config

    def config(*flags):
        return engine_config(build_parser().parse_args(["serve", *flags]))

    low = config("--tuning-profile", "low_latency")
    assert (low.scheduling_policy, low.target_itl_ms, low.preemption_mode, low.max_num_seqs) \
        == ("sjf", "auto", "auto", 64)
    mine = config("--tuning-profile", "low_latency", "--scheduling-policy", "fcfs",
                  "--target-itl-ms", "off", "--max-num-seqs", "8")
    assert (mine.scheduling_policy, mine.target_itl_ms, mine.max_num_seqs) == ("fcfs", None, 8)
    plain = config()
    assert (plain.scheduling_policy, plain.preemption_mode, plain.max_num_seqs,
            plain.target_itl_ms) == ("fcfs", "recompute", 256, None)
    assert config("--tuning-profile", "memory_constrained").max_num_batched_tokens == 512
