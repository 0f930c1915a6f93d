"""The dynamic batcher's decision, rule by rule, on hand-built queues and clocks (no threads)."""

from __future__ import annotations

import pytest

from scheduler.dynamic_batcher import (BatcherConfig, Pending, QueueFullError, QueuePolicy,
                                       RequestQueue, decide)


def queue(config, *items):
    q = RequestQueue(config)
    for p in items:
        q.push(p)
    return q


def req(name, t=0, size=1, shape=(), level=0, deadline=None):
    return Pending(name, t, size, shape, level, deadline)


def names(items):
    return [p.key for p in items]


def test_default_scheduler_runs_one_request_at_a_time_in_order():
    cfg = BatcherConfig(max_batch_size=8)
    q = queue(cfg, req("a"), req("b"))
    d = decide(q.items, 0, cfg)
    assert names(d.batch) == ["a"] and d.wait_us is None


def test_largest_formable_preferred_size_goes_at_once():
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, preferred_batch_sizes=(2, 4),
                        max_queue_delay_us=10_000_000)
    q = queue(cfg, *[req(i) for i in range(6)])
    assert names(decide(q.items, 1, cfg).batch) == [0, 1, 2, 3]
    q12 = queue(cfg, *[req(i) for i in range(12)])       # never more than the largest preferred
    assert names(decide(q12.items, 1, cfg).batch) == [0, 1, 2, 3]
    q3 = queue(cfg, *[req(i) for i in range(3)])
    assert names(decide(q3.items, 1, cfg).batch) == [0, 1]


def test_preferred_size_is_matched_on_request_boundaries():
    # sizes 3 + 3: 4 cannot be formed exactly, so it waits for the delay
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, preferred_batch_sizes=(4,),
                        max_queue_delay_us=1000)
    q = queue(cfg, req("a", 0, 3), req("b", 0, 3))
    d = decide(q.items, 10, cfg)
    assert d.batch == [] and d.wait_us == 990
    assert names(decide(q.items, 1000, cfg).batch) == ["a", "b"]


def test_queue_delay_is_honoured_then_the_batch_goes_as_it_is():
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, max_queue_delay_us=500)
    q = queue(cfg, req("a", 100), req("b", 300))
    d = decide(q.items, 200, cfg)
    assert d.batch == [] and d.wait_us == 400          # a arrived at 100, waits until 600
    assert names(decide(q.items, 600, cfg).batch) == ["a", "b"]


def test_full_batch_goes_without_waiting():
    cfg = BatcherConfig(max_batch_size=4, dynamic=True, max_queue_delay_us=10**9)
    q = queue(cfg, *[req(i, size=2) for i in range(3)])
    assert names(decide(q.items, 0, cfg).batch) == [0, 1]


def test_differently_shaped_requests_are_not_batched_together():
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, max_queue_delay_us=10**9)
    q = queue(cfg, req("a", shape=(("x", (3,)),)), req("b", shape=(("x", (5,)),)),
              req("c", shape=(("x", (3,)),)))
    # b cannot join a's batch: a's batch cannot grow in order, so it goes now
    assert names(decide(q.items, 0, cfg).batch) == ["a"]


def test_higher_priority_level_bypasses_earlier_requests():
    cfg = BatcherConfig(max_batch_size=1, dynamic=True, priority_levels=2,
                        default_priority_level=2)
    q = queue(cfg, req("low1", 0, level=2), req("low2", 1, level=2), req("high", 2, level=1))
    assert names(decide(q.items, 3, cfg).batch) == ["high"]
    assert cfg.level_of(0) == 2 and cfg.level_of(1) == 1
    assert cfg.level_of(3) == 2            # past the levels: the default, as Triton


def test_timeout_reject_and_delay():
    reject = QueuePolicy("REJECT", default_timeout_us=100)
    delay = QueuePolicy("DELAY", default_timeout_us=100)
    cfg = BatcherConfig(max_batch_size=1, dynamic=True, priority_levels=2,
                        default_priority_level=1, default_policy=reject,
                        level_policies={2: delay})
    q = queue(cfg, req("r", 0, level=1, deadline=100), req("d", 0, level=2, deadline=100),
              req("late", 50, level=2, deadline=150))
    d = decide(q.items, 120, cfg)
    assert names(d.rejected) == ["r"]
    # "d" timed out under DELAY: it goes behind "late", which has not timed out
    assert names(d.batch) == ["late"]


def test_wait_is_cut_short_by_a_queue_timeout():
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, max_queue_delay_us=1000,
                        default_policy=QueuePolicy(default_timeout_us=300))
    q = queue(cfg, req("a", 0, deadline=300))
    assert decide(q.items, 100, cfg).wait_us == 200
    d = decide(q.items, 300, cfg)
    assert names(d.rejected) == ["a"] and d.batch == []


def test_max_queue_size_per_level_and_timeout_override():
    cfg = BatcherConfig(max_batch_size=4, dynamic=True, priority_levels=2,
                        default_priority_level=1,
                        default_policy=QueuePolicy(max_queue_size=1, default_timeout_us=50),
                        level_policies={2: QueuePolicy(allow_timeout_override=True,
                                                       default_timeout_us=50)})
    q = queue(cfg, req("a", level=1))
    with pytest.raises(QueueFullError, match="Exceeds maximum queue size"):
        q.push(req("b", level=1))
    q.push(req("c", level=2))                       # another level has its own bound
    assert q.timeout_us(1, 999) == 50               # override not allowed at level 1
    assert q.timeout_us(2, 999) == 999
    q.remove(q.items[:1])
    assert names(q.items) == ["c"]
