"""What moving output processing out of the engine core saves the core, measured in-process.

Workload A at one concurrency (random prompts of `--input-len` tokens, `--output-len` tokens
out, ignore_eos, greedy, all `--concurrency` requests at once) through an `LLMEngine` with the
given flags; per step it times, separately:
- `core_ms`: `EngineCore.step` (schedule, execute, update): what the core process does now;
- `processor_ms`: `OutputProcessor.process_step` (detokenization, stop strings, deltas): what
  the core process did too before it moved to the front end — `processor_share` is its share
  of the old step (`processor / (core + processor)`);
- the pipe: one step's message pickled, sent over a `multiprocessing` pipe and unpickled by a
  child that echoes its size — the core's `EngineCoreOutputs` (token ids) against the message
  the core sent before (`("outputs", (RequestOutput deltas, [StepStats], snapshot))`), in
  microseconds and bytes, median over the decode steps.

Prints one JSON line and saves it (`--save-result`, default
benchmarks/results/engine_core_bench.json).

    python benchmarks/engine_core_bench.py [--concurrency 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core_proc import engine_snapshot  # noqa: E402
from engine.kernels.isa import isa_label  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def _echo(conn) -> None:
    """Child: receive pickled messages, answer each with its size (a round trip per message)."""
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        pickle.loads(data)
        conn.send_bytes(len(data).to_bytes(8, "little"))


def pipe_round_trip_us(conn, message) -> tuple[float, int]:
    """(microseconds to pickle `message`, send it, have it unpickled and acknowledged; bytes)."""
    t0 = time.perf_counter()
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)
    conn.recv_bytes()
    return (time.perf_counter() - t0) * 1e6, len(data)


def run(args) -> dict:
    """Build the engine, run the workload step by step, return the figures."""
    flags = dict(dtype=args.dtype, device="cpu", kv_cache_memory=2.0,
                 max_num_seqs=max(64, args.concurrency))
    if args.quantization:
        flags["quantization"] = args.quantization
    eng = LLMEngine(EngineConfig(**flags))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    for i in range(args.concurrency):
        eng.add_request(f"a-{i}", [rng.randrange(100, 49000) for _ in range(args.input_len)],
                        params)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(child,), daemon=True)
    echo.start()
    core_s, proc_s, new_pipe, old_pipe = [], [], [], []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        core_out = eng.core.step()
        t1 = time.perf_counter()
        outputs, stopped = eng.output_processor.process_step(core_out)
        t2 = time.perf_counter()
        if stopped:
            eng.core.finish_sequences(stopped)
        if len(outputs) < args.concurrency or any(len(o.outputs[0].token_ids) != 1
                                                  for o in outputs):
            continue                        # prefill and last steps: decode steps only
        core_s.append(t1 - t0)
        proc_s.append(t2 - t1)
        core_out.snapshot = engine_snapshot(eng.core)
        new_pipe.append(pipe_round_trip_us(parent, core_out))
        old_pipe.append(pipe_round_trip_us(
            parent, ("outputs", (outputs, [core_out.stats], core_out.snapshot))))
    parent.send_bytes(b"")
    echo.join(5)
    core_ms, proc_ms = statistics.median(core_s) * 1e3, statistics.median(proc_s) * 1e3
    return {"isa": isa_label(), "dtype": str(eng.dtype), "concurrency": args.concurrency,
            "decode_steps": len(core_s), "core_ms": round(core_ms, 3),
            "processor_ms": round(proc_ms, 3),
            "processor_share": round(proc_ms / (core_ms + proc_ms), 4),
            "pipe_us_core_outputs": round(statistics.median(t for t, _ in new_pipe), 1),
            "pipe_bytes_core_outputs": int(statistics.median(n for _, n in new_pipe)),
            "pipe_us_request_outputs_before": round(statistics.median(t for t, _ in old_pipe), 1),
            "pipe_bytes_request_outputs_before": int(statistics.median(n for _, n in old_pipe))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    add_save_result(ap, "engine_core_bench")
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(result))
    save_result(args.save_result, result)


if __name__ == "__main__":
    main()
