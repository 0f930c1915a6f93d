"""SLO-aware scheduling benchmark (issue "SLO-aware scheduling"), one run, ratios within it.

Every point starts `continuum serve` with the flags under test and sends ShareGPT prompts with
`continuum bench serve` (same seed, so the same prompts), then stops the server.

1. Target ITL. On the fixed-budget server: the unloaded decode step d (median ITL of one
   request alone), then the capacity (request throughput at concurrency 64). Then, for the fixed
   budget and for `--target-itl-ms 2d`: Poisson arrivals at 70% and 100% of that capacity, and
   concurrency 64. Goals: p99 ITL <= 2d and output throughput >= 0.95x the fixed budget's.
   Also reported: the most load at which every step could fit in 2d at all (`feasibility`,
   from the server's own fitted step costs, `continuum_step_cost_seconds`); the most load at
   which the p99 could, given the host's jitter (p99 / median ITL of one request alone); and
   the same pair of runs at 80% of the latter (the `feasible` point).
2. sjf vs fcfs: one burst (`--request-rate inf`) at `--max-num-seqs 8`, so a queue forms.
   Goal: lower mean end-to-end latency at the same throughput.
3. Memory pressure: a KV pool of `--pressure-blocks` blocks that forces preemption, at
   concurrency 16: swap, recompute and auto. Goal: auto >= the better of the two - 5% (output
   throughput).
Every point reports vLLM's goodput with SLOs TTFT <= `--ttft-slo-ms` and TPOT <= 2d. A plot of
the ITL distributions (CDFs) of part 1 goes to `--plot`.

Run: `python benchmarks/slo_bench.py [--num-prompts 64] [--parts itl,sjf,memory]`; the result
goes to `--save-result` (default benchmarks/results/slo_bench.json), the plot to
benchmarks/results/slo_bench_itl.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import RESULTS, add_save_result, continuum, save_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("request_throughput", "output_throughput", "request_goodput", "mean_e2el_ms",
        "p99_e2el_ms", "mean_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
        "p99_tpot_ms", "completed", "failed")


@contextmanager
def server(flags: list[str], tmp: Path, name: str):
    """A `continuum serve FLAGS` process on a free port, its log `tmp/server_NAME.log`; yields
    its base URL."""
    with open(tmp / f"server_{name}.log", "wb") as log, \
            continuum(["--uvicorn-log-level", "warning", *flags], log=log) as srv:
        yield srv.base


def bench(base: str, tmp: Path, name: str, args, extra: list[str]) -> dict:
    """`continuum bench serve` against `base` with the run's dataset and `extra` flags."""
    out = tmp / f"{name}.json"
    subprocess.run([sys.executable, "-m", "api", "bench", "serve", "--base-url", base,
                    "--dataset-name", "sharegpt", "--num-prompts", str(args.num_prompts),
                    "--seed", str(args.seed), "--no-progress", "--save-result", str(out),
                    *(["--goodput", f"ttft:{args.ttft_slo_ms}", f"tpot:{args.tpot_slo_ms}"]
                      if args.tpot_slo_ms else []), *extra],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())[0]
    print(f"{name}: " + ", ".join(f"{k} {result.get(k)}" for k in KEYS[:9]
                                  if result.get(k) is not None), flush=True)
    return result


def unloaded_decode(base: str, tmp: Path, args) -> tuple[float, float]:
    """Requests sent one at a time (8 x 128 output tokens): (median ITL in ms, the host's jitter
    ratio = p99 / median ITL). With one request and no prefill the spread is the host's alone."""
    out = tmp / "unloaded.json"
    subprocess.run([sys.executable, "-m", "api", "bench", "serve", "--base-url", base,
                    "--dataset-name", "random", "--random-input-len", "32",
                    "--random-output-len", "128", "--num-prompts", "8", "--max-concurrency", "1",
                    "--ignore-eos", "--no-progress", "--save-result", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())[0]
    return result["median_itl_ms"], result["p99_itl_ms"] / result["median_itl_ms"]


def part_itl(args, tmp: Path) -> dict:
    """Fixed budget vs --target-itl-ms 2d at 70% / 100% of capacity (Poisson) and conc 64, and
    at the `feasible` load (FEASIBLE_SHARE of the most load at which the host's jitter lets the p99
    ITL meet the target; `feasibility`).
    Every point gets a fresh server: the points send the same prompts, and a prefix cache
    warmed by an earlier point would turn its prompts into a few uncached tokens."""
    res: dict = {}
    with server([], tmp, "fixed") as base:
        d, res["jitter_ratio"] = unloaded_decode(base, tmp, args)
        res["unloaded_decode_ms"], res["target_itl_ms"] = d, round(2 * d, 2)
        args.tpot_slo_ms = res["target_itl_ms"]
        before = _engine_figures(base)
        res["fixed_c64"] = bench(base, tmp, "fixed_c64", args, ["--max-concurrency", "64"])
        res["fixed_c64"]["engine"] = _engine_figures(base, before)
    capacity = res["capacity_req_s"] = res["fixed_c64"]["request_throughput"]
    res["most_load_within_target"] = feasibility(res["fixed_c64"], res["target_itl_ms"])
    res["most_load_p99_within_target"] = most = feasibility(
        res["fixed_c64"], res["target_itl_ms"], res["jitter_ratio"])
    loads = {"p70": ["--request-rate", f"{0.7 * capacity:.4f}"],
             "p100": ["--request-rate", f"{capacity:.4f}"],
             "c64": ["--max-concurrency", "64"],
             "feasible": ["--request-rate", f"{FEASIBLE_SHARE * most * capacity:.4f}"]}
    target = ["--target-itl-ms", str(res["target_itl_ms"])]
    runs = [("fixed", [], "p70"), ("fixed", [], "p100"), ("target", target, "p70"),
            ("target", target, "p100"), ("target", target, "c64"), ("fixed", [], "feasible"),
            ("target", target, "feasible")]
    for name, flags, point in runs:
        with server(flags, tmp, f"{name}_{point}") as base:
            res[f"{name}_{point}"] = bench(base, tmp, f"{name}_{point}", args, loads[point])
            res[f"{name}_{point}"]["engine"] = _engine_figures(base)
    return res


FEASIBLE_SHARE = 0.8     # the `feasible` point's load: this share of the most the p99 target allows


def scrape(base: str) -> dict[tuple[str, str], float]:
    """`base`'s /metrics as {(sample name, its label other than model_name, or ""): value},
    read with prometheus_client's own exposition-format parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {(s.name, next((v for k, v in s.labels.items() if k != "model_name"), "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _engine_figures(base: str, before: dict | None = None) -> dict:
    """The server's fitted step-cost model (`continuum_step_cost_seconds`, seconds), and its
    steps: how many and their total seconds (`continuum_step_duration_seconds`), less
    `before`'s."""
    m, before = scrape(base), before or {}
    steps = m.get(("continuum_step_duration_seconds_count", ""), 0.0)
    seconds = m.get(("continuum_step_duration_seconds_sum", ""), 0.0)
    return {"step_cost": {term: v for (name, term), v in m.items()
                          if name == "continuum_step_cost_seconds"},
            "steps": steps - before.get("steps", 0.0),
            "step_seconds": seconds - before.get("step_seconds", 0.0)}


def work_share(run: dict) -> float:
    """Seconds of token work per second of a run: its steps' total time less `base` per step
    (the fitted fixed cost of a step: weights read, launch), over the run's duration. Only
    `base` is taken from the fitted model — its per-token terms follow the context lengths of
    the window's last steps, the step totals cover the whole run."""
    e = run["engine"]
    return (e["step_seconds"] - e["steps"] * e["step_cost"]["base"]) / run["duration"]


def feasibility(at_capacity: dict, target_ms: float, jitter_ratio: float = 1.0) -> float:
    """The most load, as a share of capacity, at which steps can fit in the target T.

    A necessary condition, from the linear step cost t = base + per_decode*D + per_prefill*P
    (`scheduler.slo`): if every step takes <= T, a second of busy time holds >= 1/T steps, each
    paying `base`, so the token work (`work_share`) can take at most 1 - base/T of it. A load of
    share x of capacity needs x times the capacity run's token work, hence
    x <= (1 - base/T) / work_share(capacity run) (`jitter_ratio` 1: every step within T).
    For the p99 ITL within T, the host's jitter must fit too: with `jitter_ratio` J = p99 /
    median ITL of one request alone, steps planned at T / J, so
    x <= (1 - J * base/T) / work_share (an approximation: it takes the jitter as proportional
    to the step's length).
    """
    base = at_capacity["engine"]["step_cost"]["base"]
    return (1 - jitter_ratio * base / (target_ms / 1000)) / work_share(at_capacity)


def part_sjf(args, tmp: Path) -> dict:
    """fcfs vs sjf on one burst at --max-num-seqs 8."""
    res = {}
    for policy in ("fcfs", "sjf"):
        with server(["--scheduling-policy", policy, "--max-num-seqs", "8"], tmp, policy) as base:
            res[policy] = bench(base, tmp, policy, args, ["--request-rate", "inf"])
    return res


def part_memory(args, tmp: Path) -> dict:
    """swap vs recompute vs auto on a KV pool that forces preemption, concurrency 16."""
    res = {}
    for mode in ("swap", "recompute", "auto"):
        flags = ["--preemption-mode", mode, "--num-gpu-blocks-override",
                 str(args.pressure_blocks), "--max-model-len", str(args.pressure_blocks * 16),
                 "--swap-space", "1"]
        with server(flags, tmp, mode) as base:
            res[mode] = bench(base, tmp, f"memory_{mode}", args, ["--max-concurrency", "16"])
            res[mode]["preemptions"] = _preemptions(base)
    return res


def _preemptions(base: str) -> dict:
    """Preemptions so far by mode (`continuum_preemptions_by_mode_total`)."""
    return {mode: v for (name, mode), v in scrape(base).items()
            if name == "continuum_preemptions_by_mode_total"}


def ratios(res: dict) -> dict:
    """The goals' figures as ratios and checks."""
    out = {}
    if "itl" in res:
        r, target = res["itl"], res["itl"]["target_itl_ms"]
        for point in ("p70", "p100", "c64", "feasible"):
            fixed, tgt = r[f"fixed_{point}"], r[f"target_{point}"]
            out[f"itl_{point}"] = {
                "p99_itl_fixed_ms": fixed["p99_itl_ms"], "p99_itl_target_ms": tgt["p99_itl_ms"],
                "target_ms": target, "p99_itl_within_target": tgt["p99_itl_ms"] <= target,
                "share_of_itls_within_target": _share(tgt["itls"], target),
                "share_of_itls_within_target_fixed": _share(fixed["itls"], target),
                "throughput_ratio": tgt["output_throughput"] / fixed["output_throughput"],
                "load_share_of_capacity": fixed["request_throughput"] / r["capacity_req_s"],
                "goodput_fixed": fixed.get("request_goodput"),
                "goodput_target": tgt.get("request_goodput")}
        out["most_load_within_target"] = r["most_load_within_target"]
        out["most_load_p99_within_target"] = r["most_load_p99_within_target"]
        out["jitter_ratio"] = r["jitter_ratio"]
        out["step_cost_ms_at_capacity"] = {
            k: v * 1000 for k, v in r["fixed_c64"]["engine"]["step_cost"].items()}
        out["work_share_at_capacity"] = work_share(r["fixed_c64"])
    if "sjf" in res:
        f, s = res["sjf"]["fcfs"], res["sjf"]["sjf"]
        out["sjf_over_fcfs"] = {k: s[k] / f[k] for k in ("mean_e2el_ms", "p99_e2el_ms",
                                                        "output_throughput") if f[k]}
    if "memory" in res:
        m = res["memory"]
        best = max(m["swap"]["output_throughput"], m["recompute"]["output_throughput"])
        out["memory"] = {"auto_over_best": m["auto"]["output_throughput"] / best,
                         **{f"{k}_tok_s": m[k]["output_throughput"] for k in m},
                         "auto_choices": m["auto"]["preemptions"]}
    return out


def _share(itls: list[float], target_ms: float) -> float:
    return sum(x * 1000 <= target_ms for x in itls) / len(itls) if itls else float("nan")


def plot(res: dict, path: Path) -> None:
    """CDFs of the ITLs of part 1 (fixed dashed, target solid), the target as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    r = res["itl"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for point, colour in (("p70", "tab:blue"), ("p100", "tab:orange"), ("c64", "tab:green"),
                          ("feasible", "tab:purple")):
        for mode, style in (("fixed", "--"), ("target", "-")):
            x = np.sort(np.array(r[f"{mode}_{point}"]["itls"]) * 1000)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), style, color=colour,
                    label=f"{mode} {point}")
    ax.axvline(r["target_itl_ms"], color="k", lw=1, label=f"target {r['target_itl_ms']} ms")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of ITLs")
    ax.set_title("ITL distribution: fixed budget vs --target-itl-ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Run the parts (flags: see --help); write and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--parts", default="itl,sjf,memory")
    p.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="default: the part-1 target (twice the unloaded decode step)")
    p.add_argument("--pressure-blocks", type=int, default=128)
    add_save_result(p, "slo_bench")
    p.add_argument("--plot", type=Path, default=RESULTS / "slo_bench_itl.png",
                   help="PNG of part 1's ITL distributions")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("itl", part_itl), ("sjf", part_sjf), ("memory", part_memory)):
            if name in parts:
                res[name] = fn(args, Path(tmp))
    res["ratios"] = ratios(res)
    save_result(args.save_result, res, indent=1)
    if "itl" in res:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(res, args.plot)
    print(json.dumps(res["ratios"], indent=1))
    return res


if __name__ == "__main__":
    main()
