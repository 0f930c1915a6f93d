"""Overload and disconnect storms against real server processes (benchmarks/stress_bench.py
drives the load; these tests hold it to what an operator relies on):

- overload, OpenAI side: a burst of 10x what the server holds gets 503 + Retry-After for the
  refused (a refusal with the server full costs well under one engine step), exact usage for
  the accepted, `/health/ready` 200 throughout, RSS flat, the engine idle afterwards;
- overload, v2 side: the same against a model's `max_queue_size`, errors in v2's shape;
- disconnect storm (`stress`: CI): 1,000 requests whose clients leave at random points leave
  running = waiting = swapped = 0, KV usage 0 on device and swap pool, RSS within a bound, and
  the next greedy output unchanged.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.stress_bench import (OVERLOAD_FLAGS, overload, overload_v2, rss_mib,
                                     slow_v2_repository, storm)
from tests.conftest import greedy, start_server, stop_server

RSS_BOUND_MIB = 100       # growth allowed across a burst / a storm after a warm-up


@pytest.mark.extended     # make test keeps test_server_e2e's queue-full 503
def test_overload_burst_is_refused_fast_and_the_accepted_are_exact(tmp_path):
    proc, base = start_server([*OVERLOAD_FLAGS, "--uvicorn-log-level", "warning"],
                              "/health/ready", tmp_path / "server.log")
    try:
        before_out = greedy(base)
        asyncio.run(overload(base, 120, 12, probes=5))          # warm-up
        rss0 = rss_mib(proc.pid)
        r = asyncio.run(overload(base, 120, 12))
        rss1 = rss_mib(proc.pid)
        print(r, rss0, rss1)
        assert r["other_statuses"] == [] and r["accepted"] + r["refused"] == 120
        assert 0 < r["accepted"] <= 12 and r["refused"] == r["refused_with_retry_after"]
        assert r["accepted_exact"] and len(r["prompt_tokens"]) == 1
        assert r["ready_statuses"] == [200] and r["ready_polls"] > 0
        assert r["fill_done_before_probes"] == 0, r       # full while the probes ran
        assert r["probes_refused"] == 50
        assert r["probe_refusal_ms_p50"] < 0.25 * r["mean_step_ms_full"], r
        assert r["idle_after_s"] is not None
        assert rss1 - rss0 < RSS_BOUND_MIB
        assert greedy(base) == before_out
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_v2_overload_respects_max_queue_size(tmp_path):
    repo = slow_v2_repository(tmp_path / "repo", max_queue_size=8, delay_ms=50)
    proc, base = start_server(["--no-llm", "--model-repository", str(repo),
                               "--uvicorn-log-level", "warning"], "/v2/health/ready",
                              tmp_path / "server.log")
    try:
        r = asyncio.run(overload_v2(base, 90))
        print(r)
        assert r["other_statuses"] == [] and r["accepted"] + r["refused"] == 90
        assert r["refused"] >= 90 - (1 + 8) - 8         # at most one queue's worth drained
        assert r["refused"] == r["refused_in_v2_shape"] and r["accepted_exact"]
        assert r["ready_statuses"] == [200]
        assert httpx.get(f"{base}/v2/health/live", timeout=5).status_code == 200
    finally:
        stop_server(proc)


@pytest.mark.stress
def test_disconnect_storm_leaves_nothing_behind(tmp_path):
    log = tmp_path / "server.log"
    # A small KV cache with swap preemption: requests are also swapped out and in.
    proc, base = start_server(["--max-model-len", "512", "--kv-cache-memory", "0.04",
                               "--preemption-mode", "swap", "--swap-space", "0.05",
                               "--max-num-seqs", "16", "--max-waiting-requests", "64",
                               "--uvicorn-log-level", "warning"], "/health/ready", log)
    try:
        before_out = greedy(base)
        asyncio.run(storm(base, 200, seed=1))                    # warm-up
        rss0 = rss_mib(proc.pid)
        r = asyncio.run(storm(base, 1000))
        rss1 = rss_mib(proc.pid)
        print(r, rss0, rss1)
        assert r["other"] == 0 and r["left"] + r["completed"] + r["refused"] == 1000
        assert r["left"] >= 100 and r["completed"] > 0
        assert r["idle_after_s"] is not None and r["idle_after_s"] < 5
        assert rss1 - rss0 < RSS_BOUND_MIB
        assert greedy(base) == before_out
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text(errors="replace")
