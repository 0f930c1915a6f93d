"""Decode-step A/B of two source trees on one GPU, in one run: is a change in
`benchmarks/device_check.py`'s step times the code's, or the machine's?

The GPU machines lent differ from one loan to the next (their host CPUs above all, which an
eager or a large-batch step waits on), so a step time is compared only with another measured
in the same run. Each tree (`--tree NAME=DIR`, a checkout holding `engine/` and
`benchmarks/device_check.py`) runs in its own process, alternating, `--rounds` times: it
builds the `device_check` perf engine (llama-3.2-1b, bfloat16, CUDA graphs unless `--eager`)
on one random-weight checkpoint built once, and times `device_check.decode_step_ms` at each
`--batches` size. Output: one JSON (`--out`) with every round's medians (ms) and, per batch
size, the median over rounds of each tree's median and the ratio of the first tree's to
each other's (> 1: that tree is faster).

Usage (from the repository root; the old tree from `git archive OLD | tar -x -C build/device/old`,
carried with build/device; the GPU image lacks llguidance, whose wheel device_bundle.py puts
there):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site build/device/wheels/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/device_ab.py --base-dir build/device/base \
        --tree old=build/device/old --tree new=. --out $OUT/device_ab.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import dataclasses, json, os, random, sys
sys.path.insert(0, os.getcwd())
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from benchmarks import device_check as dc
args = json.loads(sys.argv[1])
plan = dataclasses.replace(dc.SMOKE if args["smoke"] else dc.FULL, timed_steps=args["steps"],
                           batch_sizes=tuple(args["batches"]))
eng = dc.perf_engine(plan, args["ckpt"], eager=args["eager"])
replays, rng = dc.count_replays(eng), random.Random(0)
out = {str(b): dc.decode_step_ms(eng, plan, b, replays, rng) for b in plan.batch_sizes}
print("RESULT " + json.dumps(out), flush=True)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-dir", required=True, help="config.json + tokenizer (build/device/base)")
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                   help="a source tree to time (two or more; the first is the baseline)")
    p.add_argument("--batches", default="1,16,256")
    p.add_argument("--steps", type=int, default=40, help="timed steps per batch size")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--smoke", action="store_true",
                   help="device_check's CPU plan (tiny model, eager): a check of this script")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def build_checkpoint(base_dir: Path, work: Path, name: str, device: str) -> Path:
    """The random-weight checkpoint `name` (float32 files), built on `device`."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.checkpoints import build_checkpoint as build

    with torch.device(device):
        return build(base_dir, work / name, name)


def run_tree(directory: str, args: dict) -> dict:
    """One child process's medians per batch size (raises RuntimeError if it printed none)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=directory,
                          capture_output=True, text=True, timeout=240)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{directory}: rc {proc.returncode}\n{proc.stderr[-3000:]}")


def summary(rounds: list[dict], names: list[str], batches: list[int]) -> dict:
    """Per batch size: each tree's median over rounds of its median ms, and base / tree."""
    out = {}
    for b in batches:
        med = {n: statistics.median(r[n][str(b)]["median_ms"] for r in rounds if n in r)
               for n in names if any(n in r for r in rounds)}
        out[str(b)] = {"median_ms": med,
                       "speedup_vs_" + names[0]: {n: med[names[0]] / med[n] for n in names[1:]
                                                  if names[0] in med and n in med}}
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dab-"))      # the checkpoint: removed at the end
    try:
        return _run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a: argparse.Namespace, work: Path) -> int:
    """Build the checkpoint under `work`, time every tree each round, write `--out`."""
    t0, trees = time.perf_counter(), dict(t.split("=", 1) for t in a.tree)
    names, batches = list(trees), [int(b) for b in a.batches.split(",")]
    ckpt = build_checkpoint(Path(a.base_dir).resolve(), work,
                            *(("tiny", "cpu") if a.smoke else ("llama-3.2-1b", "cuda")))
    child = {"ckpt": str(ckpt), "steps": a.steps, "batches": batches,
             "eager": a.eager or a.smoke, "smoke": a.smoke}
    report = {"trees": trees, "args": child, "rounds": [], "errors": []}
    for i in range(a.rounds):
        row = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            try:
                row[name] = run_tree(str(Path(trees[name]).resolve()), child)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                report["errors"].append(f"round {i} {name}: {e}")
            print(f"[device_ab] round {i} {name} at {time.perf_counter() - t0:.0f} s: "
                  + json.dumps({b: r["median_ms"] for b, r in row.get(name, {}).items()}),
                  flush=True)
        report["rounds"].append(row)
        report["summary"] = summary(report["rounds"], names, batches)
        Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report.get("summary"), indent=1))
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
