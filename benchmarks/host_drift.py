"""How steady this host's CPU speed is over perf_analyzer's measurement windows.

perf_analyzer's default stability rule (`--stability-percentage 10`, 5 s windows, up to 10 of
them) accepts a measurement when, over three consecutive windows, the largest throughput is at
most 1.1 times the smallest and so is the largest average latency. A server can pass it only
if the host itself runs a fixed amount of work at a speed that steady. This probe runs a fixed
CPU-bound Python loop (no memory traffic, no I/O) on `--procs` processes and counts its passes
in windows of `--window-s` seconds; it prints each window's rate (passes/s summed over the
processes), the spread, and how many runs of three consecutive windows perf_analyzer's rule
would have accepted: the ceiling a single-threaded server measured here faces. Pin it with
`taskset -c N` to see one vCPU alone.

    python benchmarks/host_drift.py --windows 24 --window-s 5 --procs 1

Run it alone: anything else on the host is the noise it measures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import add_save_result, save_result  # noqa: E402


def _spin(windows: int, window_s: float, start: float, out) -> None:
    """Iterations of a fixed loop in each window from `start` (time.monotonic), to `out`."""
    while time.monotonic() < start:
        pass
    counts = []
    for w in range(windows):
        end, n = start + (w + 1) * window_s, 0
        while time.monotonic() < end:
            x = 0
            for i in range(2000):        # ~50 µs of interpreter work a pass
                x += i * i
            n += 1
        counts.append(n / window_s)
    out.put(counts)


def stable_triples(rates: list[float], percent: float) -> tuple[int, int]:
    """(runs of three consecutive windows whose largest rate is at most 1 + `percent` / 100
    times their smallest — perf_analyzer's test, inference_profiler.cc `IsInferWindowStable`
    — runs of three in all)."""
    ok = sum(max(rates[i:i + 3]) <= min(rates[i:i + 3]) * (1 + percent / 100)
             for i in range(len(rates) - 2))
    return ok, max(0, len(rates) - 2)


def main(argv: list[str] | None = None) -> dict:
    """Run the probe (flags: --help); print and return the windows' rates and the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--percent", type=float, default=10.0)
    add_save_result(p)
    args = p.parse_args(argv)
    from engine.kernels.isa import isa_label

    q: mp.Queue = mp.Queue()
    start = time.monotonic() + 0.5
    procs = [mp.Process(target=_spin, args=(args.windows, args.window_s, start, q))
             for _ in range(args.procs)]
    for pr in procs:
        pr.start()
    per_proc = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    rates = [sum(c[w] for c in per_proc) for w in range(args.windows)]
    ok, runs = stable_triples(rates, args.percent)
    mean = statistics.mean(rates)
    result = {"host": isa_label(), "procs": args.procs, "window_s": args.window_s,
              "rates": [round(r, 1) for r in rates],
              "min_to_max": round(min(rates) / max(rates), 3),
              "cv": round(statistics.pstdev(rates) / mean, 4),
              "stable_triples": ok, "triples": runs}
    print("rates (passes/s): " + " ".join(f"{r:.0f}" for r in rates))
    print(f"host {result['host']}, {args.procs} process(es): min/max {result['min_to_max']}, "
          f"cv {result['cv']}, triples within {args.percent:g} %: {ok} of {runs}")
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
