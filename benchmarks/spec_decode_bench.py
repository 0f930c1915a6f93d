"""Speculative decoding benchmark (issue "Speculative decoding"), one run, ratios within it.

Every configuration starts `continuum serve` with the same flags plus its `--speculative-config`
(none, ngram adaptive, ngram with `adaptive: false`, and the same two with the embedded model in
bfloat16 as the float32 target's draft), then:

1. Input-grounded, single stream: 32 prompts whose answers copy long spans of the prompt, built
   from what is installed (not typed here): 16 "rewrite this function with one change" over
   functions of the standard library (`inspect.getsource`), 16 "repeat this paragraph fixing
   the typos" over paragraphs of installed packages' METADATA descriptions with typos put in
   (letters swapped, seeded). Sent one at a time, greedy, `--grounded-max-tokens` each. Goal:
   output tok/s with ngram >= 1.8x without, every output identical.
2. Open chat: ShareGPT prompts with `continuum bench serve` at concurrency 1, 16 and 64. Goal:
   adaptive speculation (either method) >= 0.97x off in output throughput at each.
With `--repeats R` (default 3) the chat part runs R rounds; each round starts every config's
server afresh (a cold prefix cache for the same prompts) in an order rotated by one, and the
report gives each point's median over rounds of (config / off in the same round): single runs of
the c64 point were seen to vary by 16%.
While each run goes, /metrics is polled to pair the running batch size with the mean k the
scheduler chose (`continuum_spec_decode_mean_k`); acceptance rate and mean accepted length come
from the spec_decode counters (vLLM's definitions: accepted / draft tokens, and
1 + accepted / drafts).

Run: `python benchmarks/spec_decode_bench.py [--parts grounded,chat] [--save-result FILE]`
(default benchmarks/results/spec_decode_bench.json).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from benchmarks.slo_bench import _preemptions, bench, scrape, server  # noqa: E402
from engine.loader import embedded_gguf_path  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# The embedded model in bfloat16 drafting for itself in float32 (the server's default dtype).
DRAFT_BF16 = {"method": "draft_model", "model": str(embedded_gguf_path()), "dtype": "bfloat16",
              "num_speculative_tokens": 4}
CONFIGS = {
    "off": None,
    "ngram": NGRAM,
    "ngram-fixed": dict(NGRAM, adaptive=False),
    "draft-bf16": DRAFT_BF16,
    "draft-bf16-fixed": dict(DRAFT_BF16, adaptive=False),
}
STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "csv", "difflib", "calendar",
                  "string", "glob", "ipaddress", "urllib.parse", "json.decoder", "statistics",
                  "heapq", "bisect", "base64", "html", "email.utils", "gettext", "pprint",
                  "copy", "random", "quopri", "mimetypes")


# ----------------------------------------------------------------------------- prompts
def _functions(rng: random.Random) -> list[str]:
    import importlib

    out = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        funcs = [f for _, f in inspect.getmembers(module, inspect.isfunction)
                 if f.__module__ == module.__name__]
        sources = []
        for f in funcs:
            try:
                src = inspect.getsource(f)
            except (OSError, TypeError):
                continue
            if 8 <= src.count("\n") <= 30 and len(src) < 1400:
                sources.append(src)
        if sources:
            out.append(rng.choice(sorted(sources)))
    return out


def _paragraphs(rng: random.Random) -> list[str]:
    found = []
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        for para in re.split(r"\n\s*\n", body):
            text = " ".join(para.split())
            letters = sum(ch.isalpha() or ch == " " for ch in text)
            if 300 <= len(text) <= 700 and text[0].isalpha() and letters > 0.9 * len(text) \
                    and not any(mark in text for mark in ("http", "|", "`", "def ", "{")):
                found.append(text)
                break
    return rng.sample(found, min(16, len(found)))


def _typos(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 15)):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def grounded_prompts(seed: int = 0) -> list[str]:
    """The 32 input-grounded user messages (deterministic for a given seed and install)."""
    rng = random.Random(seed)
    prompts = []
    for src in _functions(rng)[:16]:
        name = re.search(r"def (\w+)", src).group(1)
        prompts.append(f"Rewrite this Python function with one change: rename it to "
                       f"`{name}_v2`. Keep everything else exactly as it is.\n\n```python\n"
                       f"{src}```")
    for para in _paragraphs(rng):
        prompts.append("Repeat this paragraph, fixing the typos and changing nothing else:\n\n"
                       + _typos(para, rng))
    return prompts[:32]


# ----------------------------------------------------------------------------- measurement
class MetricsPoller:
    """Polls /metrics every `interval` s: (running requests, mean k) samples and the final
    spec_decode counters."""

    def __init__(self, base: str, interval: float = 0.25) -> None:
        self.base, self.interval = base, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def counters(self) -> dict:
        """The spec_decode series (but the per-position one) and the running-batch gauge."""
        return {name: v for (name, _), v in scrape(self.base).items()
                if name == "continuum_num_requests_running" or (
                    name.startswith("continuum_spec_decode_") and "per_pos" not in name)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                c = self.counters()
            except httpx.HTTPError:
                continue
            if c.get("continuum_num_requests_running"):
                self.samples.append((c["continuum_num_requests_running"],
                                     c.get("continuum_spec_decode_mean_k", 0.0)))

    def __enter__(self):
        self.before = self.counters()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.counters()

    def summary(self) -> dict:
        delta = {k.removeprefix("continuum_spec_decode_").removesuffix("_total"):
                 self.after.get(k, 0.0) - self.before.get(k, 0.0)
                 for k in self.after if "_total" in k}
        drafts, tokens = delta.get("num_drafts", 0.0), delta.get("num_draft_tokens", 0.0)
        accepted = delta.get("num_accepted_tokens", 0.0)
        by_batch: dict[str, list[float]] = {}
        for running, k in self.samples:
            bucket = "1" if running <= 1 else "2-8" if running <= 8 else "9-32" \
                if running <= 32 else "33+"
            by_batch.setdefault(bucket, []).append(k)
        return {"draft_tokens": tokens, "accepted_tokens": accepted,
                "acceptance_rate": accepted / tokens if tokens else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "mean_k_by_running": {b: round(sum(v) / len(v), 2) for b, v in by_batch.items()}}


def run_grounded(base: str, prompts: list[str], max_tokens: int) -> dict:
    """Sends `prompts` one at a time (greedy); output tok/s over the whole run and the texts."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                   messages=[{"role": "user", "content": "warm up"}])
    texts, tokens = [], 0
    with MetricsPoller(base) as poll:
        t0 = time.perf_counter()
        for p in prompts:
            r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                               messages=[{"role": "user", "content": p}])
            texts.append(r.choices[0].message.content)
            tokens += r.usage.completion_tokens
        seconds = time.perf_counter() - t0
    return {"output_tok_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds,
            "texts": texts, **poll.summary()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="grounded,chat")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--grounded-max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--chat-prompts", default="12,64,128",
                    help="ShareGPT prompts per concurrency level (one count per level)")
    ap.add_argument("--chat-output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3,
                    help="chat rounds; each round starts every config's server afresh, in an "
                         "order rotated by one per round, and the report gives median ratios")
    ap.add_argument("--seed", type=int, default=0)
    add_save_result(ap, "spec_decode_bench")
    ap.add_argument("--server-flags", default="", help="extra flags for every server")
    args = ap.parse_args(argv)
    parts, configs = args.parts.split(","), args.configs.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.chat_prompts.split(",")]
    if len(counts) != len(levels):
        ap.error(f"--chat-prompts has {len(counts)} counts for {len(levels)} concurrency levels")
    results: dict = {"grounded": {}, "chat": []}
    tmp = Path(tempfile.mkdtemp(prefix="spec_bench_"))
    rounds = max(1, args.repeats) if "chat" in parts else 1
    for r in range(rounds):
        results["chat"].append({})
        for name in configs[r % len(configs):] + configs[:r % len(configs)]:
            flags = args.server_flags.split() + (
                ["--speculative-config", json.dumps(CONFIGS[name])] if CONFIGS[name] else [])
            with server(flags, tmp, f"{name}_r{r}") as base:
                if "grounded" in parts and r == 0:
                    g = results["grounded"][name] = run_grounded(
                        base, grounded_prompts(args.seed), args.grounded_max_tokens)
                    print(f"grounded {name}: {g['output_tok_s']:.1f} tok/s, acceptance "
                          f"{g['acceptance_rate']}, k by running {g['mean_k_by_running']}",
                          flush=True)
                if "chat" in parts:
                    results["chat"][r].update(run_chat(base, tmp, f"{name}_r{r}", name, args,
                                                       zip(levels, counts)))
    report(results, levels)
    save_result(args.save_result, results, indent=1)


def run_chat(base: str, tmp: Path, tag: str, name: str, args, points) -> dict:
    """`continuum bench serve` on ShareGPT at each (concurrency, prompts) point, with the
    spec_decode counters and preemptions of each; keys `{name}_c{level}`."""
    out = {}
    for level, count in points:
        chat_args = argparse.Namespace(num_prompts=count, seed=args.seed, tpot_slo_ms=None)
        before = _preemptions(base)
        with MetricsPoller(base) as poll:
            r = bench(base, tmp, f"{tag}_c{level}", chat_args,
                      ["--max-concurrency", str(level), "--sharegpt-output-len",
                       str(args.chat_output_len), "--endpoint", "chat"])
        after = _preemptions(base)
        out[f"{name}_c{level}"] = {
            "output_throughput": r["output_throughput"], "median_itl_ms": r.get("median_itl_ms"),
            "preemptions": sum(after.values()) - sum(before.values()), **poll.summary()}
    return out


def report(results: dict, levels: list[int]) -> None:
    """Prints the goals' ratios: grounded speed-up and identity, and per chat point the median
    over rounds of (config / off in the same round)."""
    g = results["grounded"]
    if "off" in g:
        for name in g:
            if name == "off":
                continue
            same = sum(a == b for a, b in zip(g[name]["texts"], g["off"]["texts"]))
            print(f"grounded {name} / off: {g[name]['output_tok_s'] / g['off']['output_tok_s']:.2f}x"
                  f" output tok/s; identical outputs {same}/{len(g['off']['texts'])}; acceptance "
                  f"{g[name]['acceptance_rate']}, mean accepted length "
                  f"{g[name]['mean_accepted_length']}")
    rounds = results["chat"]
    for level in levels:
        for name in [n for n in CONFIGS if n != "off"]:
            pairs = [(c[f"{name}_c{level}"], c[f"off_c{level}"]) for c in rounds
                     if f"{name}_c{level}" in c and f"off_c{level}" in c]
            if not pairs:
                continue
            each = [on["output_throughput"] / off["output_throughput"] for on, off in pairs]
            on = pairs[0][0]
            results.setdefault("median_ratios", {})[f"{name}_c{level}"] = \
                statistics.median(each)
            print(f"chat c{level} {name} / off: median {statistics.median(each):.2f}x output "
                  f"tok/s (rounds: {', '.join(f'{x:.2f}' for x in each)}); preemptions "
                  f"{[p[0]['preemptions'] for p in pairs]} vs off {[p[1]['preemptions'] for p in pairs]};"
                  f" acceptance {on['acceptance_rate']}, k by running {on['mean_k_by_running']}")


if __name__ == "__main__":
    main()
