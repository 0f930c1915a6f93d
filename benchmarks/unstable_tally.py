"""How often perf_analyzer could not stabilise each server, over saved triton_protocol_bench runs.

Issue 54 counts a measurement perf_analyzer cannot stabilise at its defaults as a failure; on
some host classes tritonserver 2.51 fails that rule too. This script reads result files of
`benchmarks/triton_protocol_bench.py` (also the older shape that nests runs one level deeper,
e.g. `{"run1": {"continuum": ..., "triton": ...}}`) and prints, per file and in total, the
kept rounds that did not stabilise over all kept rounds, per server. Retried attempts
(`--steal-retry`) are not counted: only the round each point kept.

    python benchmarks/unstable_tally.py benchmarks/results/triton_protocol_bench_avx2_*.json

Output: one line per file and a total line, e.g. `continuum 2/72  triton 4/72`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

SERVERS = ("continuum", "triton")


def tally(result: dict) -> tuple[Counter, Counter]:
    """(unstable rounds, all rounds) per server name in one saved result."""
    unstable, total = Counter(), Counter()

    def walk(node: dict, server: str | None) -> None:
        for key, value in node.items():
            if not isinstance(value, dict):
                continue
            name = key if key in SERVERS else server
            if "rounds" in value and name is not None:
                total[name] += len(value["rounds"])
                unstable[name] += sum("error" in r for r in value["rounds"])
            else:
                walk(value, name)

    walk(result, None)
    return unstable, total


def line(unstable: Counter, total: Counter) -> str:
    """`continuum u/n  triton u/n` for the servers present."""
    return "  ".join(f"{s} {unstable[s]}/{total[s]}" for s in SERVERS if total[s])


def main(argv: list[str] | None = None) -> tuple[Counter, Counter]:
    """Print each file's tally and the sum; returns the sum (unstable, total)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    args = p.parse_args(argv)
    unstable, total = Counter(), Counter()
    for path in args.results:
        u, t = tally(json.loads(path.read_text()))
        print(f"{path.name}: {line(u, t)}")
        unstable += u
        total += t
    print(f"total: {line(unstable, total)}")
    return unstable, total


if __name__ == "__main__":
    main()
