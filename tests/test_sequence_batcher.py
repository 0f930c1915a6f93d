"""The sequence batcher's decisions, rule by rule, on hand-built sequences and clocks (no
threads, no server): slots, padding, the backlog, idle sequences, backlog timeouts, oldest."""

from __future__ import annotations

import pytest

from scheduler.sequence_batcher import SeqItem, SequenceBatcher, SequenceConfig, SequenceError


def item(corrid, start=False, end=False, t=0, shape=()):
    return SeqItem(f"{corrid}{'S' if start else ''}{'E' if end else ''}@{t}", corrid, start,
                   end, t, shape)


def keys(entries):
    return [None if it is None else it.key for _, it in entries]


def direct(slots=4, **kw):
    return SequenceBatcher(SequenceConfig("direct", 1, slots, slots, **kw))


def test_direct_batch_spans_slot_zero_to_the_highest_ready_slot_with_padding():
    b = direct()
    for c in (1, 2, 3):
        b.enqueue(item(c, start=True), 0)
    entries, _ = b.next_batch(0, 0)
    assert keys(entries) == ["1S@0", "2S@0", "3S@0"]
    b.enqueue(item(3, t=1), 1)                      # only slot 2 ready: slots 0, 1 padded
    entries, wait = b.next_batch(0, 1)
    assert keys(entries) == [None, None, "3@1"] and wait is None
    assert [s.index for s, _ in entries] == [0, 1, 2]


def test_a_sequence_keeps_its_slot_and_end_frees_it_lowest_first():
    b = direct(slots=2)
    assert b.enqueue(item("a", start=True), 0).index == 0
    assert b.enqueue(item("b", start=True), 0).index == 1
    b.enqueue(item("a", end=True), 0)
    b.next_batch(0, 0)                              # a's START and b's START
    b.next_batch(0, 0)                              # a's END: slot 0 free again
    assert b.enqueue(item("c", start=True), 1).index == 0


def test_sequences_beyond_the_slots_wait_in_a_fifo_backlog():
    b = direct(slots=1)
    b.enqueue(item("a", start=True), 0)
    assert b.enqueue(item("b", start=True), 0) is None       # backlog
    assert b.enqueue(item("c", start=True, end=True), 0) is None
    b.enqueue(item("b", t=1), 1)                    # joins b's backlog
    assert keys(b.next_batch(0, 2)[0]) == ["aS@0"]
    b.enqueue(item("a", end=True, t=3), 3)
    assert keys(b.next_batch(0, 3)[0]) == ["aE@3"]  # slot freed: b (first in) takes it
    assert keys(b.next_batch(0, 4)[0]) == ["bS@0"]
    assert keys(b.next_batch(0, 4)[0]) == ["b@1"]
    b.enqueue(item("b", end=True), 5)
    b.next_batch(0, 5)
    assert keys(b.next_batch(0, 6)[0]) == ["cSE@0"]
    assert len(b) == 0


def test_a_request_without_start_for_an_unknown_sequence_is_refused():
    b = direct()
    with pytest.raises(SequenceError, match="must specify the START flag"):
        b.enqueue(item(9), 0)
    b.enqueue(item(9, start=True, end=True), 0)
    b.next_batch(0, 0)
    with pytest.raises(SequenceError):              # ended
        b.enqueue(item(9), 1)


def test_an_idle_sequence_loses_its_slot():
    b = direct(slots=1, max_sequence_idle_us=100)
    b.enqueue(item("a", start=True), 0)
    b.next_batch(0, 0)
    rejected, touched, wait = b.reap(50)
    assert not rejected and wait == 50
    rejected, touched, _ = b.reap(100)
    assert touched == {0}
    assert b.next_batch(0, 100) == ([], None)      # the marker frees the slot
    with pytest.raises(SequenceError):
        b.enqueue(item("a"), 101)
    assert b.enqueue(item("b", start=True), 101).index == 0


def test_a_backlogged_sequence_expires_on_its_timeout():
    b = direct(slots=1)
    b.enqueue(item("a", start=True), 0)
    b.enqueue(item("b", start=True), 0, timeout_us=30)
    b.enqueue(item("b", t=5), 5)
    rejected, _, wait = b.reap(10)
    assert not rejected and wait == 20
    rejected, _, _ = b.reap(30)
    assert [r.key for r in rejected] == ["bS@0", "b@5"]
    with pytest.raises(SequenceError):
        b.enqueue(item("b"), 31)


def test_direct_waits_for_slot_utilization_up_to_the_queue_delay():
    b = direct(slots=4, max_queue_delay_us=100, minimum_slot_utilization=0.5)
    b.enqueue(item("a", start=True, t=0), 0)
    entries, wait = b.next_batch(0, 10)
    assert entries == [] and wait == 91
    b.enqueue(item("b", start=True, t=20), 20)      # 2 of 4 slots ready: utilization met
    assert keys(b.next_batch(0, 20)[0]) == ["aS@0", "bS@20"]
    b.enqueue(item("a", t=30), 30)
    assert keys(b.next_batch(0, 131)[0]) == ["a@30"]   # the delay passed


def test_differently_shaped_heads_are_padded_out_of_a_direct_batch():
    b = direct()
    b.enqueue(item("a", start=True, shape=(1,)), 0)
    b.enqueue(item("b", start=True, shape=(2,)), 0)
    assert keys(b.next_batch(0, 0)[0]) == ["aS@0", None]
    assert keys(b.next_batch(0, 0)[0]) == [None, "bS@0"]


def test_oldest_batches_ready_heads_oldest_first_without_padding():
    b = SequenceBatcher(SequenceConfig("oldest", 1, 4, 2, max_queue_delay_us=0))
    for t, c in enumerate("abc"):
        b.enqueue(item(c, start=True, t=t), t)
    b.enqueue(item("a", t=5), 5)
    assert keys(b.next_batch(0, 10)[0]) == ["aS@0", "bS@1"]       # max_batch_size 2
    assert keys(b.next_batch(0, 10)[0]) == ["cS@2", "a@5"]


def test_slots_spread_over_instances():
    b = SequenceBatcher(SequenceConfig("direct", 2, 1, 1))
    assert b.enqueue(item("a", start=True), 0).instance == 0
    assert b.enqueue(item("b", start=True), 0).instance == 1
    assert keys(b.next_batch(0, 0)[0]) == ["aS@0"]
    assert keys(b.next_batch(1, 0)[0]) == ["bS@0"]


def test_finish_ends_a_sequence_without_an_end_request():
    b = direct(slots=1)
    b.enqueue(item("it", start=True), 0)
    b.next_batch(0, 0)
    assert b.finish("it") == 0
    assert b.next_batch(0, 1) == ([], None)
    assert b.enqueue(item("next", start=True), 2).index == 0
