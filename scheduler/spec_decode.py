"""Speculative decoding, the scheduler's half: the configuration, each request's acceptance
window, and the per-step choice of how many drafts each request verifies. Pure: no torch, no
clocks; the engine proposes the drafts (`engine.spec_decode`) and feeds in its step timings.

In: a request's proposed drafts (`Request.spec_token_ids`: the runner proposes them with each
step's output, `Scheduler.update_from_output` keeps them), the step's measured cost model
(`scheduler.slo.LatencyHistory`), and after the step how many drafts were accepted
(`record_verification`). Out: k per request for this step, and counters for /metrics.

Adaptive speculation (the rule). A request whose drafts are accepted with probability a each
(i.i.d., the model of Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", sec. 3.1) emits E(k) = 1 + a + a^2 + ... + a^k tokens when it verifies k drafts, so
its j-th draft adds a^j expected tokens. A draft is one more row in the step: it costs c seconds
(the measured marginal cost of a row, `LatencyHistory.row_cost`). With N expected tokens and
T predicted seconds so far (N = the step's decodes, T = the model's time of a step with them),
adding a draft of gain g raises N / T iff g / c > N / T. Gains fall along each request's drafts
(a^1 > a^2 > ...) and every draft costs the same c, so taking drafts in decreasing order of gain
while g / c > N / T maximises N / T (the Dinkelbach argument for a ratio objective). At batch 1
on a copying prompt (a near 1, N / T = 1 / T small against 1 / c) every draft pays; in a big batch
N / T approaches 1 / c and only near-certain drafts do, so speculation switches itself off.
With a draft model every draft also needs a row of a drafting pass (the draft runs only for
requests that draft: `engine.spec_decode.draft_model`), so each costs c + c_d (c_d: the measured
seconds per row of those passes, `DraftCost`); the same argument holds with g / (c + c_d). A
request that sat out some steps makes the draft catch up those positions when it drafts again;
that one-off cost is not charged (it is at most the tokens the draft skipped).
This is seed 002's AdaptiveSpeculator with its constant "draft costs 10%" replaced by the
measured c and T. `a` comes from the request's recent steps (a ring buffer, seed 002's
UpdateAcceptRate): a step that verified d drafts and accepted m of them tested m + (m < d)
drafts (those after the first rejection were never tested) and passed m; the estimate is
(passed + PRIOR_TESTED * prior) / (tested + PRIOR_TESTED) over the window, so it never reaches 0
or 1. The prior is the pooled estimate over all requests' recent steps (empirical Bayes, as in
Efron and Morris 1973: a new request is assumed to accept like the recent ones), PRIOR_ACCEPTED /
PRIOR_TESTED before any step verified a draft. A fixed prior would lock a new request out when
drafts are dear: at a prior below the break-even acceptance it never drafts, so never learns.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from dataclasses import dataclass, field, fields

SPEC_METHODS = ("ngram", "draft_model")
ACCEPT_WINDOW = 16            # steps of one request kept in its acceptance window
PRIOR_ACCEPTED = 1.4          # pseudo-counts: before any draft was verified, assume 70%
PRIOR_TESTED = 2.0
POOLED_WINDOW = 256           # request-steps (all requests) in the pooled acceptance window


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's keys).

    method: "ngram" (prompt lookup) or "draft_model" (a smaller model with the same tokenizer).
    num_speculative_tokens: the most drafts per request per step (k), at least 1.
    prompt_lookup_min / prompt_lookup_max: n-gram lengths the ngram proposer matches, in tokens.
    model / dtype: the draft model (HF directory or GGUF) and its dtype ("auto" = the target's).
    adaptive: choose k per request and step by measured cost (module docstring); False = always
        verify every proposed draft.
    Raises ValueError naming the key for an unknown key or a bad value.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    dtype: str = "auto"
    adaptive: bool = True

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> None:
            raise ValueError(f"--speculative-config: {key} {why}, got {getattr(self, key)!r}")

        if self.method not in SPEC_METHODS:
            bad("method", f"must be one of {', '.join(SPEC_METHODS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(key, "must be a positive integer")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad("prompt_lookup_min", f"must not exceed prompt_lookup_max "
                                     f"({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            bad("adaptive", "must be true or false")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad("dtype", "must be auto, float32, bfloat16 or float16")
        if self.method == "draft_model" and not self.model:
            bad("model", "is required with method draft_model")
        if self.method == "ngram" and self.model is not None:
            bad("model", "is only used with method draft_model")

    @classmethod
    def parse(cls, value: str | dict) -> SpeculativeConfig:
        """From the flag's JSON text (or a dict). Raises ValueError naming the bad key."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; expected "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class AcceptanceWindow:
    """Recent speculation outcomes, (drafts tested, drafts passed) per request-step: one
    request's (`ACCEPT_WINDOW` steps) or all requests' pooled (`pooled()`)."""

    steps: deque = field(default_factory=lambda: deque(maxlen=ACCEPT_WINDOW))

    @classmethod
    def pooled(cls) -> AcceptanceWindow:
        """A window over the last `POOLED_WINDOW` request-steps of every request."""
        return cls(deque(maxlen=POOLED_WINDOW))

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts and accepted the first `num_accepted`."""
        if num_drafts > 0:
            self.steps.append((num_accepted + (num_accepted < num_drafts), num_accepted))

    def rate(self, prior: float = PRIOR_ACCEPTED / PRIOR_TESTED) -> float:
        """Estimated per-draft acceptance probability, in (0, 1) for a prior in (0, 1):
        `PRIOR_TESTED` pseudo-draws at the `prior` rate, then the window's."""
        tested = sum(t for t, _ in self.steps)
        passed = sum(p for _, p in self.steps)
        return (passed + PRIOR_TESTED * prior) / (tested + PRIOR_TESTED)


@dataclass
class SpecDecodeCounters:
    """Cumulative speculation counters (vLLM's spec_decode metrics) and the last step's mean k."""

    num_drafts: int = 0                 # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # accepted at draft position i
    mean_k: float = 0.0                 # mean drafts chosen per decode in the last step

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_drafts` drafts, the first `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.append(0)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


def choose_num_drafts(candidates: list[tuple[int, float]], num_decodes: int,
                      step_seconds: float | None, row_seconds: float | None,
                      draft_seconds: float = 0.0) -> list[int]:
    """Drafts to verify per candidate (the module docstring's rule).

    candidates: (drafts available, acceptance estimate a) per decoding request that has drafts.
    num_decodes: decode rows in the step (candidates included). step_seconds: predicted time of
    the step without drafts; row_seconds: marginal cost of one more row. Either None (not yet
    measured) = verify everything available (measure first). draft_seconds: what making one
    draft costs on top (a draft model's row in a drafting pass; 0 for n-gram drafts).
    Returns k per candidate, 0 <= k <= drafts available.
    """
    if step_seconds is None or row_seconds is None or row_seconds <= 0 or step_seconds <= 0:
        return [avail for avail, _ in candidates]
    chosen = [0] * len(candidates)
    extra = row_seconds + draft_seconds
    # By gain per second of cost; along one request both fall, so its drafts come in order.
    heap = [(-a / extra, a, i) for i, (avail, a) in enumerate(candidates) if avail > 0]
    heapq.heapify(heap)
    tokens, seconds = float(max(num_decodes, 1)), step_seconds
    while heap:
        neg_ratio, gain, i = heap[0]
        if -neg_ratio * seconds <= tokens:            # g / c <= N / T: no draft left pays
            break
        heapq.heappop(heap)
        tokens += gain
        seconds += extra
        chosen[i] += 1
        avail, a = candidates[i]
        if chosen[i] < avail:
            heapq.heappush(heap, (-gain * a / extra, gain * a, i))
    return chosen


class DraftCost:
    """Seconds per row of a draft model's drafting passes (those without catch-up), over a
    moving window of (rows, seconds) per step; None before any was measured."""

    def __init__(self, window: int = 64) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        """A step's drafting passes computed `rows` rows in `seconds`."""
        if rows > 0:
            self.steps.append((rows, seconds))

    def per_row(self) -> float | None:
        """Mean seconds per drafting row over the window."""
        rows = sum(r for r, _ in self.steps)
        return sum(t for _, t in self.steps) / rows if rows else None


def record_verification(req, num_drafts: int, num_accepted: int,
                        counters: SpecDecodeCounters, pooled: AcceptanceWindow) -> None:
    """A request (`Request`) verified `num_drafts` drafts and accepted the first
    `num_accepted`: into its own acceptance window (made on its first verification), the
    `pooled` window and the cumulative `counters`. Called by the scheduler's update."""
    if req.spec_window is None:
        req.spec_window = AcceptanceWindow()
    req.spec_window.record(num_drafts, num_accepted)
    counters.record(num_drafts, num_accepted)
    pooled.record(num_drafts, num_accepted)


def plan_drafts(running: list, config, latency, counters: SpecDecodeCounters,
                draft_cost: DraftCost | None = None,
                pooled: AcceptanceWindow | None = None) -> dict[str, int]:
    """This step's drafts per request id, for the running requests (`Request`s) in decode
    with proposed drafts (n-gram), or every one without structured outputs (draft model: the
    runner drafts during the step). A request never verifies more drafts than
    `num_speculative_tokens`, than positions left before `max_model_len`, or than tokens left
    before `max_tokens` minus one (so verification never computes past what the request may
    emit). With `config.spec_adaptive`, `choose_num_drafts` decides from `latency` (a
    `LatencyHistory`), `draft_cost` and each request's acceptance window with the `pooled`
    window's rate as its prior. Sets `counters.mean_k`."""
    k_max, limit = config.num_speculative_tokens, config.max_model_len
    on_demand = config.spec_method == "draft_model"
    candidates, ids = [], []
    num_decodes = 0
    prior = pooled.rate() if pooled is not None else PRIOR_ACCEPTED / PRIOR_TESTED
    for req in running:
        tokens = req.all_token_ids
        if not req.forked or req.num_computed_tokens != len(tokens) - 1:
            continue
        num_decodes += 1
        if on_demand:
            if req.sampling_params.structured_outputs is not None:
                continue
            proposed = k_max
        else:
            proposed = len(req.spec_token_ids)
            if not proposed:
                continue
        max_tokens = req.sampling_params.max_tokens
        room = limit - len(tokens)
        if max_tokens is not None:
            room = min(room, max_tokens - (len(tokens) - req.num_prompt_tokens) - 1)
        avail = min(proposed, k_max, room)
        if avail > 0:
            window = req.spec_window
            candidates.append((avail, window.rate(prior) if window is not None else prior))
            ids.append(req.request_id)
    if not config.spec_adaptive:
        chosen = [avail for avail, _ in candidates]
    else:
        per_row = draft_cost.per_row() if draft_cost is not None else None
        chosen = choose_num_drafts(candidates, num_decodes, latency.predict(num_decodes, 0),
                                   latency.row_cost(), per_row or 0.0)
    counters.mean_k = sum(chosen) / num_decodes if num_decodes else 0.0
    return {rid: k for rid, k in zip(ids, chosen) if k}
