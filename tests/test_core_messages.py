"""What crosses the engine core's pipe each step, and how often: the step messages read back
unchanged (they pickle positionally), the scheduler snapshot goes out where it is due rather
than every step, and the metrics layer, which folds the steps it is handed in batches, still
shows every step at a scrape and at idle."""

from __future__ import annotations

import pickle

from api.metrics import Metrics
from engine import core_proc
from engine.core_proc import EngineCoreProc
from engine.outputs import EngineCoreOutputs, RequestMetrics, StepStats
from scheduler.output import RequestStepOutput
from scheduler.request import RequestStatus
from scheduler.stats import SchedulerCounters, snapshot


def test_step_messages_read_back_unchanged():
    outputs = [RequestStepOutput(f"r{s.value}", [s.value, 7], s, stop_reason="x" if s else None,
                                 logprobs=[(1, -0.5)], parent_id="p", index=s.value,
                                 error="bad" if s is RequestStatus.FINISHED_ERROR else None)
               for s in RequestStatus]
    msg = EngineCoreOutputs(outputs=outputs, prompt_logprobs={"r0": (3, [])},
                            scheduled=[("r1", 12.5, 32)],
                            stats=StepStats(2, 9, 7, 0.004, 0.0001, 3,
                                            [("stop", RequestMetrics(1.0, 1.5), 5, 3)], False),
                            snapshot={"num_running": 1})
    back = pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
    assert back == msg
    assert [o.status for o in back.outputs] == list(RequestStatus)
    assert all(type(o.status) is RequestStatus for o in back.outputs)
    assert pickle.loads(pickle.dumps(EngineCoreOutputs())) == EngineCoreOutputs()


class _Scheduler:
    def __init__(self) -> None:
        self.running, self.waiting, self.swapped = ["a"], [], []

    def snapshot(self, step_cost: bool = True) -> dict:
        return {"num_running": len(self.running), "step_cost": step_cost}


class _Core:
    def __init__(self) -> None:
        self.scheduler, self.lora, self.unfinished = _Scheduler(), None, True

    def step(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(stats=StepStats(1, 1, 0, 0.001, 0.0001))

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


def test_the_snapshot_goes_out_when_counts_change_at_idle_and_at_least_every_interval(
        monkeypatch):
    now = [100.0]
    monkeypatch.setattr(core_proc.time, "monotonic", lambda: now[0])
    core, sent = _Core(), []
    proc = EngineCoreProc(core, sent.append)

    def step(dt: float = 0.001):
        now[0] += dt
        proc.step()
        return sent[-1].snapshot

    assert step() is not None                       # the first step
    assert [step() for _ in range(5)] == [None] * 5  # same counts, within the interval
    core.scheduler.waiting.append("b")
    assert step()["num_running"] == 1               # a request queued
    assert step() is None
    assert step(core_proc.SNAPSHOT_S) is not None   # the interval passed
    core.scheduler.running.pop()
    assert step()["num_running"] == 0               # a request finished
    core.unfinished = False
    last = step()
    assert last is not None and last["step_cost"] is True   # the last step before idle
    assert all(m.stats is not None for m in sent)   # every step's stats go out


def _snap(running: int, waiting: int) -> dict:
    return snapshot(num_running=running, num_waiting=waiting, num_swapped=0,
                    kv_cache_usage=0.5 if running else 0.0, cpu_kv_cache_usage=0.0,
                    prefill_budget=2048, counters=SchedulerCounters(prefix_cache_queries=4))


def test_metrics_show_every_step_at_a_scrape_and_at_idle():
    m = Metrics("m")

    def value(name: str) -> float | None:
        return m.registry.get_sample_value(name, {"model_name": "m"})

    for _ in range(3):              # busy: kept, fewer than FOLD_STEPS
        m.on_engine_stats([StepStats(1, 1, 0, 0.002, 0.0001, 1)], None)
    m.on_engine_stats([StepStats(1, 1, 0, 0.002, 0.0001, 1)], _snap(1, 0))
    text = m.render().decode()      # a scrape sees all four steps
    assert "continuum_generation_tokens_total{model_name=\"m\"} 4.0" in text
    assert value("continuum_num_requests_running") == 1
    assert value("continuum_iteration_tokens_total_count") == 4

    m.on_engine_stats([StepStats(1, 1, 0, 0.002, 0.0001, 2,
                                 [("stop", RequestMetrics(1.0, 1.1, 1.2, 1.3, 1.4), 5, 6)])],
                      _snap(0, 0))  # the last step before idle: folded at once
    assert value("continuum_generation_tokens_total") == 6
    assert value("continuum_num_requests_running") == 0
    assert value("continuum_prefix_cache_queries_total") == 4
    assert m.registry.get_sample_value("continuum_request_success_total",
                                       {"model_name": "m", "finished_reason": "stop"}) == 1


def test_metrics_of_several_api_processes_fold_every_step_at_once(monkeypatch, tmp_path):
    """With --api-server-count's multiprocess files another process may answer the scrape, and
    only process 0 sees the idle snapshot: nothing may wait in this process."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    m = Metrics("m")
    m.on_engine_stats([StepStats(0, 0, 0, 0.0, 0.0, 3, [("length", RequestMetrics(1.0), 4, 3)],
                                 engine_wide=False)], None)
    assert m.registry.get_sample_value("continuum_generation_tokens_total",
                                       {"model_name": "m"}) == 3
