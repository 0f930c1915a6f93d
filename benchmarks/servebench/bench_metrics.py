"""Serving-benchmark metrics with vLLM's definitions (`vllm/benchmarks/serve.py`,
`calculate_metrics`), computed from per-request timings.

Per request: TTFT = first streamed token - send; E2EL = last byte - send; ITL = gaps between
streamed chunks that carried tokens; TPOT = (E2EL - TTFT) / (output tokens - 1), only for
requests with more than one output token. Aggregates: mean / median / std / percentiles in
milliseconds, request and token throughputs over the wall-clock duration, and goodput = requests
meeting every SLO (`ttft`, `tpot`, `e2el` in ms) per second.

The result keys are vLLM's (`completed`, `failed`, `duration`, `request_throughput`,
`output_throughput`, `total_token_throughput`, `mean_ttft_ms`, `median_ttft_ms`, `p99_ttft_ms`,
...), so existing tooling reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds; token counts in tokens."""

    success: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0                     # E2EL
    itl: list[float] = field(default_factory=list)
    error: str = ""
    generated_text: str = ""


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` → `{"ttft": 200.0, "tpot": 50.0}` (milliseconds).

    Raises: ValueError naming a bad entry (unknown metric, not a positive number).
    """
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: unknown metric {name!r} (use ttft, tpot, e2el)")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {spec!r} needs a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput: {spec!r} must be positive")
    return slos


def tpot_of(r: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1), or None with fewer than two output tokens."""
    if r.output_len <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_len - 1)


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: tuple[float, ...] = (50, 90, 99),
                      goodput_slos: dict[str, float] | None = None) -> dict:
    """Aggregate per-request results of one run (`duration` seconds of wall clock)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in map(tpot_of, ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success and r.error}),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    if goodput_slos is not None:
        good = sum(1 for r in ok if _meets(r, goodput_slos))
        out["request_goodput"] = good / duration if duration else 0.0
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.asarray(values, dtype=float) * 1000.0
        empty = ms.size == 0
        out[f"mean_{name}_ms"] = 0.0 if empty else float(ms.mean())
        out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = 0.0 if empty else float(ms.std())
        for p in percentiles:
            key = f"p{int(p) if float(p).is_integer() else p}_{name}_ms"
            out[key] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "e2el": r.latency, "tpot": tpot_of(r) or 0.0}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())
