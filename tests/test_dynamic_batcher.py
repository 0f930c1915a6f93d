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


def _random_queue_run(rng, ops: int):
    """One random life of a queue (pushes at random levels, timeouts under REJECT and DELAY,
    own timeouts out of arrival order, preferred sizes, shapes, a custom rule), checking at
    every step that the queue's `decide` is the pure rule's over the same requests."""
    cfg = BatcherConfig(max_batch_size=rng.choice([1, 4, 8]), dynamic=rng.random() < 0.9,
                        preferred_batch_sizes=rng.choice([(), (2,), (2, 4)]),
                        max_queue_delay_us=rng.choice([0, 50, 500]), priority_levels=3,
                        default_priority_level=2,
                        default_policy=QueuePolicy("REJECT", allow_timeout_override=True),
                        level_policies={1: QueuePolicy("DELAY", allow_timeout_override=True,
                                                       default_timeout_us=80)})
    q, now, n = RequestQueue(cfg), 0, 0
    include = (lambda p: p.key % 5 != 3) if rng.random() < 0.3 else None
    for _ in range(ops):
        now += rng.choice([0, 1, 10, 60])
        if rng.random() < 0.6:
            level = rng.choice([1, 2, 3])
            timeout = q.timeout_us(level, rng.choice([None, 30, 200]))
            q.push(req(n, now, rng.choice([1, 1, 2]), rng.choice([(), (("x", (2,)),)]),
                       level, now + timeout if timeout else None))
            n += 1
            continue
        want = decide(q.items, now, cfg, include)
        got = q.decide(now, include)
        assert (names(got.batch), sorted(names(got.rejected)), got.wait_us) == \
            (names(want.batch), sorted(names(want.rejected)), want.wait_us)
        q.remove(got.rejected)
        if rng.random() < 0.7:
            q.remove(got.batch)
        assert len(q) == len(q.items)
    return n


def test_the_queue_decides_as_the_pure_rule_in_o_batch():
    import random
    rng = random.Random(7)
    assert sum(_random_queue_run(rng, 200) for _ in range(300)) > 30_000


class _Counted(Pending):
    """A request that counts every attribute read of any request of its kind."""

    reads = 0

    def __getattribute__(self, name):
        _Counted.reads += 1
        return object.__getattribute__(self, name)


def test_a_long_queue_drains_in_batches_without_rescanning_it():
    # each decision reads one batch's requests, not the whole queue: a burst of n drains in
    # O(n) reads (sorting and scanning the queue per decision made it O(n^2): 4,000 requests
    # in batches of 8 read ~4 x 10^6 attributes, and 20,000 took ~17 s of the server's GIL)
    cfg = BatcherConfig(max_batch_size=8, dynamic=True, max_queue_delay_us=100,
                        default_policy=QueuePolicy(default_timeout_us=10**9))
    n = 4_000
    q = queue(cfg, *[_Counted(i, 0, 1, (), 0, 10**9) for i in range(n)])
    _Counted.reads, taken = 0, 0
    while len(q):
        d = q.decide(10**6)
        assert not d.rejected and len(d.batch) == 8
        q.remove(d.batch)
        taken += len(d.batch)
    assert taken == n and _Counted.reads < 40 * n
