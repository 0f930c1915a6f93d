"""Cost models the scheduler decides by: the step's prefill budget against a target ITL, and
swap against recompute at a preemption. Pure: the engine feeds in its own measured timings; no
clocks, threads or tensors here.

In: `observe_step(num_decodes, num_prefill_tokens, seconds)` after every engine step and
`observe_swap(num_blocks, seconds)` after every swap (and once at start, a calibration copy).
Out: `prefill_budget(num_decodes)` (tokens; `for_step` reads the decodes and the starvation
off the scheduler's lists) and `prefer_swap(num_blocks, num_tokens)`.

Step cost model (`LatencyHistory`, a moving window): a step carrying D decodes and P prefill
tokens costs  t = base + per_decode * D + per_prefill_token * P  seconds, fitted by least
squares on the window (decode-only steps and steps with prefill are kept in separate windows,
so a long decode-only phase does not push out what prefill costs). When the window cannot tell
the three apart (e.g. every decode step had the same batch size) or the joint fit goes
negative: base and per_decode come from the decode-only steps alone, and per_prefill_token is
what the prefill steps cost beyond them per token (a ratio estimate through the origin). A
coefficient with no data yet is None.

Adaptive prefill budget (Sarathi-Serve, Agrawal et al., OSDI 2024, sec. 4: a token budget per
iteration chosen so that stall-free batches keep the TBT / ITL SLO; here the budget is not
profiled once but follows the measured window): with target T,
    budget = (T - margin - drift - base - per_decode * D) / per_prefill_token,
clamped to [floor, max_num_batched_tokens - D], where margin is the MARGIN_QUANTILE (99th)
percentile of how much the window's steps with prefill ran over the model's prediction (the
host's jitter: planning at the mean would put half of the budgeted steps over the target). The
host's speed drifts in spells of several steps (on a shared 2-core host the lag-1
autocorrelation of the residuals is ~0.5), so the prediction carries a drift term: k times the
last step's residual, k the least-squares lag-1 coefficient of the window's consecutive
residuals (clamped to [0, 1]); the margin is then taken over the residuals less that drift,
which on such a host cuts the 90th / 99th percentile from ~11 / 24 ms to ~8 / 17 ms. Until a
prefill cost is measured the budget is the fixed `max_num_batched_tokens`. The percentile is the
99th because the goal is the p99 ITL: at the 90th, one step with prefill in ten overran by
design (measured, 0.60 req/s ShareGPT on a 2-core host: p99 ITL 86 ms against a 74 ms target at
the 90th percentile without drift, 76 ms at the 99th with it).

The floor keeps prefills moving whatever the load, but only once they starve: while some request
with prompt tokens still to compute has been waiting `patience` steps or more (counted from its
arrival), every step spends at least `floor` tokens on prefill (when the step's seats and blocks
allow); before that the budget is what the slack gives, even 0. A floor that applied at once
would, on a host where the floor's chunk alone overshoots the target, put every prefill's chunks
over it even at light load, where the slack left by the decodes would have carried the prompt
within the target in a few more steps. So with fcfs a waiting request with W prompt tokens of
earlier requests still to compute ahead of it starts its prefill within patience + ceil(W /
floor) + 1 steps of its arrival: once it has waited `patience` steps, the floor holds at every
step until it starts. The patience is 256 steps (~13 s at 50 ms a step): a floor chunk beside
the decodes overruns the target almost every time (77 of 78 such steps in one run at 32 steps'
patience), and queueing of a few seconds is normal at 70% load, so a short patience spent most
of the tail there.

Preemption cost (`--preemption-mode auto`): swapping a request out and back in moves its blocks
twice, 2 * blocks * seconds_per_block (the measured copy time per block, i.e. bytes over the
measured copy bandwidth); recomputing it costs its computed tokens x per_prefill_token. The
cheaper wins; recompute when the swap pool is full (the scheduler's own fallback).
"""

from __future__ import annotations

from collections import deque

import numpy as np

DEFAULT_WINDOW = 64           # steps in the moving window
DEFAULT_FLOOR = 32            # tokens: the adaptive budget's least prefill per step
DEFAULT_PATIENCE = 256        # steps a request may wait before the floor applies
MARGIN_QUANTILE = 99          # percentile of the prefill steps' overrun kept as margin
MIN_MARGIN_STEPS = 8          # prefill steps needed before the margin is measured


class LatencyHistory:
    """Moving window of engine step timings and the linear step-cost model fitted on it.

    Units: seconds, tokens. `window`: how many recent steps of each kind (decode-only, with
    prefill) are kept. Raises ValueError for a window below 2.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 2:
            raise ValueError(f"the latency window must hold at least 2 steps, got {window}")
        # (step index, D, t) and (step index, D, P, t): the index orders the two windows
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.prefill_steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._steps = 0
        self._fit: tuple[float | None, float | None, float | None] | None = None
        self._row_seen = False         # whether the fit saw per_decode (not the fallback split)
        self._jitter: tuple[float, float] | None = None      # (margin, drift) seconds

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record one step: D decode rows, P prefill tokens, its wall time in seconds."""
        if num_decodes <= 0 and num_prefill_tokens <= 0:
            return                                  # an empty step says nothing about cost
        self._steps += 1
        if num_prefill_tokens > 0:
            self.prefill_steps.append((self._steps, num_decodes, num_prefill_tokens, seconds))
        else:
            self.decode_steps.append((self._steps, num_decodes, seconds))
        self._fit = self._jitter = None

    def coefficients(self) -> tuple[float | None, float | None, float | None]:
        """(base, per_decode, per_prefill_token) in seconds; None where there is no data."""
        if self._fit is None:
            self._fit = self._fit_joint()
            self._row_seen = self._fit is not None or \
                len({d for _, d, _ in self.decode_steps}) > 1
            if self._fit is None:
                base, per_decode = _fit_decode(self.decode_steps)
                self._fit = (base, per_decode,
                             self._fit_prefill(base or 0.0, per_decode or 0.0))
        return self._fit

    def row_cost(self) -> float | None:
        """Seconds one more row (a decode or a speculative draft) adds to a step: per_decode
        when the window shows it (the joint fit, or decode-only steps of different batch
        sizes), else per_prefill_token; None without data."""
        base, per_decode, per_token = self.coefficients()
        if self._row_seen and per_decode is not None:
            return per_decode
        return per_token

    def _fit_joint(self) -> tuple[float, float, float] | None:
        """Least squares of t on [1, D, P] over both windows; None if not identifiable or
        not non-negative."""
        if not self.decode_steps or not self.prefill_steps:
            return None
        rows = [(1.0, d, 0.0, t) for _, d, t in self.decode_steps] + \
               [(1.0, d, p, t) for _, d, p, t in self.prefill_steps]
        a = np.array(rows, dtype=np.float64)
        coef, _, rank, _ = np.linalg.lstsq(a[:, :3], a[:, 3], rcond=None)
        if rank < 3 or (coef < 0).any():
            return None
        return float(coef[0]), float(coef[1]), float(coef[2])

    def _fit_prefill(self, base: float, per_decode: float) -> float | None:
        if not self.prefill_steps:
            return None
        _, d, p, t = np.array(self.prefill_steps, dtype=np.float64).T
        extra = t - base - per_decode * d
        return max(float(np.dot(extra, p) / np.dot(p, p)), 0.0)

    def margin(self) -> float:
        """Seconds: the MARGIN_QUANTILE percentile of how far the window's steps with prefill
        ran over the model's prediction plus its drift term, at least 0; 0 without a fitted
        model or before MIN_MARGIN_STEPS steps with prefill."""
        return self._measure_jitter()[0]

    def drift(self) -> float:
        """Seconds the next step is expected to run over (or, negative, under) the model: k x
        the last step's residual (see the module docstring); 0 without a fitted model."""
        return self._measure_jitter()[1]

    def _measure_jitter(self) -> tuple[float, float]:
        """(margin, drift), cached until the next `observe`."""
        if self._jitter is None:
            self._jitter = (0.0, 0.0)
            if self.coefficients()[2] is not None and len(self.prefill_steps) >= MIN_MARGIN_STEPS:
                self._jitter = self._residual_spells()
        return self._jitter

    def _residual_spells(self) -> tuple[float, float]:
        """The window's residuals in step order, their lag-1 coefficient k, and from them
        (margin, drift)."""
        steps = [(i, d, 0, t) for i, d, t in self.decode_steps] + list(self.prefill_steps)
        i, d, p, t = np.array(sorted(steps), dtype=np.float64).T
        resid = t - self.predict(d, p)
        follows = np.diff(i) == 1                     # (step j-1, step j) both in the window
        prev, cur = resid[:-1][follows], resid[1:][follows]
        k = 0.0
        if len(prev) >= MIN_MARGIN_STEPS and np.dot(prev, prev) > 0:
            k = float(np.clip(np.dot(prev, cur) / np.dot(prev, prev), 0.0, 1.0))
        before = np.concatenate(([0.0], np.where(follows, resid[:-1], 0.0)))
        over = (resid - k * before)[p > 0]
        margin = max(float(np.percentile(over, MARGIN_QUANTILE)), 0.0)
        return margin, k * float(resid[-1])

    def predict(self, num_decodes, num_prefill_tokens):
        """Predicted step seconds for D decodes and P prefill tokens (ints, or numpy arrays of
        them for one prediction per element); None without data."""
        base, per_decode, per_token = self.coefficients()
        if base is None and per_token is None:
            return None
        return ((base or 0.0) + (per_decode or 0.0) * num_decodes
                + (per_token or 0.0) * num_prefill_tokens)


def _fit_decode(steps) -> tuple[float | None, float | None]:
    """Non-negative least squares of t = base + per_decode * D on decode-only steps
    ((index, D, t) rows)."""
    if not steps:
        return None, None
    _, d, t = np.array(steps, dtype=np.float64).T
    if len(steps) < 2 or np.ptp(d) == 0:          # one batch size: no slope to see
        return float(np.mean(t)) / 2, float(np.mean(t)) / 2 / max(float(np.mean(d)), 1.0)
    slope, intercept = np.polyfit(d, t, 1)
    if slope < 0:
        return float(np.mean(t)), 0.0
    if intercept < 0:
        return 0.0, float(np.dot(d, t) / np.dot(d, d))
    return float(intercept), float(slope)


class AdaptivePrefillBudget:
    """The per-step prefill token budget that keeps a step within `target_itl_s` (see the
    module docstring for the rule and its bound).

    target_itl_s: seconds; max_num_batched_tokens: the step's token cap; floor: least prefill
    tokens per step once a request has waited `patience` steps. Raises ValueError for a
    non-positive target or floor, or a negative patience.
    """

    def __init__(self, target_itl_s: float, max_num_batched_tokens: int,
                 floor: int = DEFAULT_FLOOR, history: LatencyHistory | None = None,
                 patience: int = DEFAULT_PATIENCE) -> None:
        if not target_itl_s > 0:
            raise ValueError(f"--target-itl-ms must be positive, got {target_itl_s * 1000}")
        if floor < 1:
            raise ValueError(f"the prefill floor must be at least 1 token, got {floor}")
        if patience < 0:
            raise ValueError(f"the prefill patience must be >= 0 steps, got {patience}")
        self.patience = patience
        self.target_itl_s = target_itl_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.floor = min(floor, max_num_batched_tokens)
        self.history = history or LatencyHistory()
        self.last_budget = max_num_batched_tokens

    def prefill_budget(self, num_decodes: int, starved: bool = True) -> int:
        """Prefill tokens allowed in a step that carries `num_decodes` decodes; the floor
        applies when `starved` (a request with prefill to do has waited `patience` steps)."""
        base, per_decode, per_token = self.history.coefficients()
        cap = max(self.max_num_batched_tokens - num_decodes, 0)
        if per_token is None or per_token <= 0:
            budget = cap
        else:
            slack = (self.target_itl_s - self.history.margin() - self.history.drift()
                     - (base or 0.0) - (per_decode or 0.0) * num_decodes)
            budget = int(slack / per_token + 1e-6) if slack > 0 else 0
        self.last_budget = min(max(budget, self.floor if starved else 0), cap)
        return self.last_budget

    def for_step(self, running, waiting, swapped, step: int) -> int:
        """The scheduler's step number `step`: its prefill budget from the running decodes (each
        counts its `max_num_running_seqs`), with the floor once a request with prompt tokens
        still to compute (waiting, or running with a partial prefill) was added `patience` or
        more steps ago. `running` and `swapped` are lists of `scheduler.request.Request`s,
        `waiting` yields (key, request) pairs. A step with no prompt tokens to compute keeps
        the last budget: refitting the step costs (~0.3 ms) would buy nothing there."""
        oldest = step - self.patience
        num_decodes, starved, prefilling = 0, False, False
        for r in running:
            pending = len(r.all_token_ids) - 1 - r.num_computed_tokens
            if pending == 0:
                num_decodes += r.max_num_running_seqs
            elif pending > 0:
                prefilling = True
                starved = starved or r.arrival_step <= oldest
        if not (prefilling or waiting or swapped):
            return self.last_budget
        starved = starved or any(r.arrival_step <= oldest for _, r in waiting)
        return self.prefill_budget(num_decodes, starved)


class PreemptionCost:
    """Swap vs recompute by measured cost (`--preemption-mode auto`).

    `history` gives the prefill cost per token; `observe_swap` the copy time per block.
    """

    def __init__(self, history: LatencyHistory, window: int = DEFAULT_WINDOW) -> None:
        self.history = history
        self.swaps: deque[tuple[int, float]] = deque(maxlen=window)    # (blocks, seconds)

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        """Record one copy of `num_blocks` blocks between device and swap pool."""
        if num_blocks > 0:
            self.swaps.append((num_blocks, seconds))

    def seconds_per_block(self) -> float | None:
        """Measured copy time per block (one direction); None before any copy."""
        blocks = sum(b for b, _ in self.swaps)
        return sum(s for _, s in self.swaps) / blocks if blocks else None

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether swapping `num_blocks` out and back in is cheaper than recomputing
        `num_tokens`. Without a measurement of either, swap (it keeps finished work)."""
        per_block = self.seconds_per_block()
        per_token = self.history.coefficients()[2]
        if per_block is None or per_token is None:
            return True
        return 2 * num_blocks * per_block <= num_tokens * per_token
