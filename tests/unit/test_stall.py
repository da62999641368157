"""The coordinator's stalled-partition watch (pure)."""

from __future__ import annotations

from twophase.coordinator.stall import StallWatch

A, B = ("orders", 0), ("orders", 1)


def test_a_partition_that_keeps_moving_never_stalls() -> None:
    w = StallWatch(alarm_after_s=30)
    for i in range(10):
        r = w.observe(i * 10.0, {A: 100 * i}, {A: 100 * i + 500})
        assert r.stalled_s[A] == 0.0 and not r.alarmed


def test_records_waiting_behind_a_position_that_does_not_move_raise_then_clear() -> None:
    w = StallWatch(alarm_after_s=30)
    assert w.observe(0.0, {A: 10, B: 10}, {A: 10, B: 50}).stalled_s == {A: 0.0, B: 0.0}
    r = w.observe(20.0, {A: 10, B: 10}, {A: 10, B: 60})
    assert r.stalled_s == {A: 0.0, B: 20.0} and not r.alarmed
    r = w.observe(31.0, {A: 10, B: 10}, {A: 10, B: 70})
    assert r.alarmed == r.raised == {B} and not r.cleared
    r = w.observe(40.0, {A: 10, B: 10}, {A: 10, B: 70})
    assert r.alarmed == {B} and not r.raised  # raised once
    r = w.observe(50.0, {A: 10, B: 11}, {A: 10, B: 70})  # moved: the clock starts again
    assert r.stalled_s[B] == 0.0 and r.cleared == {B} and not r.alarmed
    assert w.observe(79.0, {A: 10, B: 11}, {A: 10, B: 70}).stalled_s[B] == 29.0


def test_an_idle_partition_is_not_stalled_however_long_it_waits() -> None:
    w = StallWatch(alarm_after_s=5)
    for t in (0.0, 100.0, 1000.0):
        assert w.observe(t, {A: 42}, {A: 42}).stalled_s[A] == 0.0
    # Records arrive after a long quiet spell: the clock starts when they begin to wait, not
    # when the position last moved.
    r = w.observe(1001.0, {A: 42}, {A: 43})
    assert r.stalled_s[A] == 1.0 and not r.alarmed
    assert w.observe(1006.0, {A: 42}, {A: 43}).alarmed == {A}


def test_a_partition_never_committed_counts_from_its_first_sighting() -> None:
    w = StallWatch(alarm_after_s=5)
    assert w.observe(0.0, {}, {A: 100}).stalled_s[A] == 0.0
    assert w.observe(6.0, {}, {A: 100}).alarmed == {A}
    assert w.observe(7.0, {A: 100}, {A: 100}).cleared == {A}


def test_reset_and_vanished_partitions() -> None:
    w = StallWatch(alarm_after_s=5)
    w.observe(0.0, {A: 1, B: 1}, {A: 9, B: 9})
    assert w.observe(6.0, {A: 1, B: 1}, {A: 9}).alarmed == {A}  # B no longer read
    assert w.observe(7.0, {A: 1, B: 1}, {A: 9, B: 9}).stalled_s[B] == 0.0  # B seen anew
    w.reset()
    r = w.observe(8.0, {A: 1}, {A: 9})
    assert r.stalled_s[A] == 0.0 and not r.alarmed and not r.cleared
