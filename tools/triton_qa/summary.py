#!/usr/bin/env python3
"""Markdown table of benchmarks/results/triton_qa/*.json: per suite (and
Triton ref), tritonserver's counts next to Continuum's. A result whose tag
ends in "head" (run.py --tag head / main-head, Continuum served from a
`git archive HEAD` copy) goes in its own column; any other tag part
(e.g. trials-1-2-4-v) makes its own row.

    python3 tools/triton_qa/summary.py [--problems]
"""
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
RESULTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "results", "triton_qa")


def cell(report):
    if report is None:
        return "not run"
    t = report["totals"]
    text = f"{t['passed']} / {t['failed']} / {t['error']} / {t['skipped']} / {t['hung']}"
    if report.get("timed_out"):
        text += " (suite timed out)"
    if not any(t.values()):
        why = [m for m in report.get("script_messages", [])
               if "not ready" in m or "Failed to start" in m or "Server not running" in m]
        text += f" (no test ran: {why[0].strip('=* ')})" if why else " (no test ran)"
    return text


def load():
    table = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            report = json.load(f)
        tag = report.get("tag", "")
        variant = "-".join(p for p in tag.split("-") if p not in ("main", "head", ""))
        suite = report["suite"] + (f" ({variant})" if variant else "")
        key = (suite, report.get("triton_ref", ""))
        column = report["server"] + ("-head" if tag.endswith("head") else "")
        table.setdefault(key, {})[column] = report
    return table


def main():
    table = load()
    print("| suite | Triton qa ref | tritonserver 2.51 | Continuum | Continuum HEAD |")
    print("| --- | --- | --- | --- | --- |")
    for (suite, ref), by_server in sorted(table.items()):
        print(f"| {suite} | {ref} | {cell(by_server.get('triton'))} | "
              f"{cell(by_server.get('continuum'))} | {cell(by_server.get('continuum-head'))} |")
    print("\ncounts: passed / failed / error / skipped / hung")
    if "--problems" in sys.argv:
        for (suite, ref), by_server in sorted(table.items()):
            report = by_server.get("continuum")
            for p in (report or {}).get("problems", []):
                print(f"- {suite} [{ref}] {p['outcome']}: {p['test']} {p['context'] or ''}: "
                      f"{p['message'][:250]}")


if __name__ == "__main__":
    main()
