"""SLO-aware scheduling without a clock: the step-cost model, the adaptive prefill budget
(target ITL) and its admission bound, and `--preemption-mode auto`, driven by the synthetic
step costs a `FakeRunner` reports (as the engine reports measured ones)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.slo import AdaptivePrefillBudget, LatencyHistory, PreemptionCost
from tests.fake_runner import FakeRunner, StepCost, check_invariants, run_steps

COST = StepCost(base=0.010, per_decode=0.001, per_token=0.0005, per_block=0.0001)


def history_from(cost: StepCost, steps) -> LatencyHistory:
    h = LatencyHistory()
    for d, p in steps:
        h.observe(d, p, cost.step(d, p))
    return h


def test_the_step_cost_model_recovers_linear_costs():
    h = history_from(COST, [(d, 0) for d in (1, 4, 9, 16)] + [(3, 100), (0, 512), (8, 40)])
    base, per_decode, per_token = h.coefficients()
    assert base == pytest.approx(COST.base) and per_decode == pytest.approx(COST.per_decode)
    assert per_token == pytest.approx(COST.per_token)
    assert h.predict(10, 200) == pytest.approx(COST.step(10, 200))


def test_the_window_forgets_old_costs():
    h = history_from(StepCost(per_token=0.01), [(2, 64)] * 64)
    for _ in range(64):                                    # the host got 10x faster
        h.observe(2, 64, StepCost(per_token=0.001).step(2, 64))
    assert h.coefficients()[2] == pytest.approx(0.001, rel=0.2)


def test_budget_fills_the_slack_left_by_decodes_and_keeps_its_floor():
    h = history_from(COST, [(d, 0) for d in (1, 4, 9, 16)] + [(3, 100), (0, 512)])
    b = AdaptivePrefillBudget(0.050, 2048, floor=32, history=h)
    assert b.prefill_budget(10) == 60          # (50 - 10 - 10) ms / 0.5 ms per token
    assert b.prefill_budget(0) == 80
    assert b.prefill_budget(45) == 32          # decodes alone overshoot: the floor
    assert b.prefill_budget(45, starved=False) == 0   # ... once a prefill has waited long enough
    assert b.prefill_budget(10, starved=False) == 60  # the slack needs no floor
    assert AdaptivePrefillBudget(10.0, 2048, history=h).prefill_budget(8) == 2040  # the cap
    assert AdaptivePrefillBudget(0.050, 2048).prefill_budget(8) == 2040   # nothing measured


def test_bad_targets_fail_with_the_flag_name():
    with pytest.raises(ValueError, match="--target-itl-ms"):
        SchedulerConfig(target_itl_ms=0)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(target_itl_ms=20, enable_chunked_prefill=False, max_model_len=64,
                        max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="--preemption-mode"):
        SchedulerConfig(preemption_mode="sometimes")


def scheduler(target_itl_ms=None, mode="recompute", num_blocks=512, num_cpu_blocks=0,
              budget=2048, max_num_seqs=64, max_model_len=1024) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, target_itl_ms=target_itl_ms,
                                     preemption_mode=mode),
                     CacheConfig(4, num_blocks, num_cpu_blocks, False))


def request(i: int, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(f"r{i}", [(i * 7 + k) % 90 + 4 for k in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                   eos_token_id=3, arrival_time=float(i))


def step_costs(target_itl_ms, prompts=(700,) * 4, patience=None):
    """16 decoding requests (started one a step), then `prompts` (their lengths): the true
    cost of every step from the prompts' arrival on."""
    s = scheduler(target_itl_ms=target_itl_ms)
    if patience is not None:
        s.prefill_budgeter.patience = patience
    runner = FakeRunner(s, COST)
    for i in range(16):                  # one new request a step: the model sees varied steps
        s.add_request(request(i, 8, max_tokens=60))
        s.update_from_output(out := s.schedule(), runner.execute(out))
    for i, n in enumerate(prompts, start=16):
        s.add_request(request(i, n, max_tokens=4))
    costs = []
    while s.has_unfinished_requests():
        out = s.schedule()
        check_invariants(s, out)
        decodes = sum(1 for r in out.scheduled if len(r.token_ids) == 1)
        costs.append(COST.step(decodes, out.num_scheduled_tokens - decodes))
        s.update_from_output(out, runner.execute(out))
    return costs


def test_with_a_target_steps_stay_within_it_while_decodes_run():
    """Once measured, no step exceeds the 50 ms target (the fixed 2048-token budget puts
    whole prompts into the decodes' steps); everything drains. (At 16 decodes a step costs
    26 ms, so the 32-token floor, 16 ms, fits the target.)"""
    assert max(step_costs(None)) > 0.3
    assert max(step_costs(50)) <= 0.050 + 1e-9


def test_at_light_load_the_slack_carries_a_prompt_the_floor_would_push_over_the_target():
    """Beside 16 decodes (26 ms) a 30 ms target leaves 4 ms, 8 prefill tokens, a step; the
    32-token floor alone costs 16 ms. One 64-token prompt waits less than `patience` steps, so
    it goes in 8-token chunks within the target; with the floor at once (patience 0) its
    chunks overshoot."""
    assert max(step_costs(30, prompts=(64,))) <= 0.030 + 1e-9
    assert max(step_costs(30, prompts=(64,), patience=0)) > 0.040


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(2, 300), min_size=2, max_size=12),
       floor=st.sampled_from([8, 32]), patience=st.sampled_from([0, 1, 5]))
def test_every_waiting_request_starts_within_the_stated_bound(prompts, floor, patience):
    """Costs so high that the slack is nil and the budget sits at its floor once a request has
    waited `patience` steps: with fcfs, request i starts its prefill within
    patience + ceil(W_i / floor) + 1 steps, W_i = prompt tokens of the requests ahead."""
    s = scheduler(target_itl_ms=1)
    s.prefill_budgeter.floor, s.prefill_budgeter.patience = floor, patience
    runner = FakeRunner(s, StepCost(base=0.5, per_token=0.1))
    for i, n in enumerate(prompts):
        s.add_request(request(i, n, max_tokens=3))
    started: dict[str, int] = {}
    step = 0
    while s.has_unfinished_requests():
        step += 1
        out = s.schedule()
        check_invariants(s, out)
        for r in out.scheduled:
            started.setdefault(r.request_id, step)
        s.update_from_output(out, runner.execute(out))
    for i in range(len(prompts)):
        ahead = sum(prompts[:i])
        assert started[f"r{i}"] <= patience + math.ceil(ahead / floor) + 1, (i, started, prompts)


def test_auto_swaps_when_copying_is_cheaper_and_recomputes_when_it_is_not():
    cheap = PreemptionCost(history_from(COST, [(1, 0), (2, 0), (0, 100)]))
    cheap.observe_swap(10, 0.001)                             # 0.1 ms per block
    assert cheap.prefer_swap(num_blocks=8, num_tokens=32)     # 1.6 ms vs 16 ms
    dear = PreemptionCost(cheap.history)
    dear.observe_swap(10, 0.2)                                # 20 ms per block
    assert not dear.prefer_swap(num_blocks=8, num_tokens=32)  # 320 ms vs 16 ms
    assert PreemptionCost(LatencyHistory()).prefer_swap(8, 32)   # nothing measured: swap


@pytest.mark.parametrize("per_block, mode_used", [(1e-6, "swap"), (1.0, "recompute")])
def test_auto_preemption_follows_measured_costs_and_outputs_stay_exact(per_block, mode_used):
    def run(mode, per_block):
        s = scheduler(mode=mode, num_blocks=24, num_cpu_blocks=64, max_num_seqs=8,
                      max_model_len=64)
        s.observe_swap(8, 8 * per_block)          # the engine's calibration copy at start
        for i in range(6):
            s.add_request(request(i, 20, max_tokens=16))
        return s, run_steps(s, FakeRunner(s, StepCost(per_block=per_block)),
                            check=check_invariants)

    s, outputs = run("auto", per_block)
    counters = s.counters
    assert counters.num_preemptions > 0
    used = {"swap": counters.num_preemptions_swap,
            "recompute": counters.num_preemptions_recompute}
    assert used[mode_used] == counters.num_preemptions
    assert outputs == run("recompute", per_block)[1]


def test_auto_recomputes_when_the_swap_pool_is_full():
    s = scheduler(mode="auto", num_blocks=24, num_cpu_blocks=1, max_num_seqs=8,
                  max_model_len=64)
    for i in range(6):
        s.add_request(request(i, 20, max_tokens=16))
    run_steps(s, FakeRunner(s, StepCost(per_block=1e-6)), check=check_invariants)
    assert s.counters.num_preemptions_recompute > 0 and s.counters.num_preemptions_swap == 0


def test_jittery_steps_widen_the_margin_and_shrink_the_budget():
    """Steps that run over the model by up to 10 ms leave the budget room for that jitter."""
    calm = history_from(COST, [(d, p) for d in (1, 4, 9) for p in (0, 50, 200)] * 4)
    jittery = LatencyHistory()
    for i, (d, p) in enumerate([(d, p) for d in (1, 4, 9) for p in (0, 50, 200)] * 4):
        jittery.observe(d, p, COST.step(d, p) + (0.010 if i % 2 else 0.0))
    assert calm.margin() == pytest.approx(0.0, abs=1e-9)
    assert 0.003 < jittery.margin() <= 0.010
    assert AdaptivePrefillBudget(0.060, 2048, history=jittery).prefill_budget(4) \
        < AdaptivePrefillBudget(0.060, 2048, history=calm).prefill_budget(4)


def test_a_slow_spell_shrinks_the_next_budget_and_a_fast_one_widens_it():
    """The host slows down 12 ms for spells of 6 steps: a step inside a slow spell predicts the
    next one slow too (the drift term), so the budget planned there is smaller than the one
    planned inside a fast spell, by about the drift over the cost per prefill token."""
    mix = [(d, p) for d in (1, 4, 9) for p in (0, 50, 200)] * 8

    def history(num_steps):
        h = LatencyHistory()
        for i, (d, p) in enumerate(mix[:num_steps]):
            h.observe(d, p, COST.step(d, p) + (0.012 if (i // 6) % 2 else 0.0))
        return h

    slow, fast = history(60), history(66)          # the last step: in a slow / a fast spell
    assert slow.drift() > 0.004 > 0 > fast.drift()
    budget_slow = AdaptivePrefillBudget(0.080, 2048, history=slow).prefill_budget(4, False)
    budget_fast = AdaptivePrefillBudget(0.080, 2048, history=fast).prefill_budget(4, False)
    assert budget_slow < budget_fast
    expected = (slow.drift() - fast.drift()) / COST.per_token
    assert budget_fast - budget_slow == pytest.approx(
        expected + (slow.margin() - fast.margin()) / COST.per_token, abs=2)


def test_alternating_jitter_has_no_drift():
    """Jitter that flips every step tells nothing about the next: no drift term."""
    h = LatencyHistory()
    for i, (d, p) in enumerate([(d, p) for d in (1, 4, 9) for p in (0, 50, 200)] * 4):
        h.observe(d, p, COST.step(d, p) + (0.010 if i % 2 else 0.0))
    assert h.drift() == 0.0
