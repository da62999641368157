"""The data thread's consume waits briefly only while a PREPARE is due (a consume that does not
fill its batch waits out its whole timeout, and a PREPARE read meanwhile waits for it)."""

from __future__ import annotations

from twophase.participants.runtime.participant import (
    CONSUME_TIMEOUT_DUE_S,
    CONSUME_TIMEOUT_S,
    PREPARE_DUE_S,
    consume_timeout,
)

LEAD, GRACE = PREPARE_DUE_S


def test_short_only_around_the_next_prepare_and_after_a_drained() -> None:
    seen, interval = 100.0, 1.0
    never = -1e9  # no DRAINED sent

    def at(now: float, drained: float = never) -> float:
        return consume_timeout(now, seen, interval, drained)

    # Just after a PREPARE, through most of the interval: the long wait (no spinning).
    for now in (seen, seen + 0.3, seen + interval - LEAD - 0.01):
        assert at(now) == CONSUME_TIMEOUT_S, now
    # From a little before the next one is due until a little after: the short one.
    for now in (seen + interval - LEAD, seen + interval, seen + interval + GRACE):
        assert at(now) == CONSUME_TIMEOUT_DUE_S, now
    # A PREPARE that is late beyond the grace: long again (a slow cycle, a stopped coordinator).
    assert at(seen + interval + GRACE + 0.01) == CONSUME_TIMEOUT_S
    # A DRAINED just sent may start a cycle at once, whatever the interval says.
    assert at(seen + 0.3, drained=seen + 0.2) == CONSUME_TIMEOUT_DUE_S
    assert at(seen + 0.3, drained=seen + 0.3 - GRACE - 0.01) == CONSUME_TIMEOUT_S
    assert CONSUME_TIMEOUT_DUE_S < CONSUME_TIMEOUT_S
