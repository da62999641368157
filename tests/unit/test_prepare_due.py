"""While a PREPARE is due the data thread waits on the control thread, which wakes it with the
PREPARE, not in a consume (which waits out its whole timeout unless its batch fills, and a
PREPARE read meanwhile would wait for it); only then, so an idle participant does not spin."""

from __future__ import annotations

from twophase.participants.runtime.participant import (
    CONSUME_TIMEOUT_S,
    PREPARE_DUE_S,
    prepare_due,
)

LEAD, GRACE = PREPARE_DUE_S


def test_due_only_around_the_next_prepare_and_after_a_drained() -> None:
    seen, interval = 100.0, 1.0
    never = -1e9  # no DRAINED sent

    def at(now: float, drained: float = never) -> bool:
        return prepare_due(now, seen, interval, drained)

    # Just after a PREPARE, through most of the interval: not due (the consume's wait).
    for now in (seen, seen + 0.3, seen + interval - LEAD - 0.01):
        assert not at(now), now
    # From a little before the next one is due until a little after: due.
    for now in (seen + interval - LEAD, seen + interval, seen + interval + GRACE):
        assert at(now), now
    # A PREPARE that is late beyond the grace: not due (a slow cycle, a stopped coordinator).
    assert not at(seen + interval + GRACE + 0.01)
    # A DRAINED just sent may start a cycle at once, whatever the interval says.
    assert at(seen + 0.3, drained=seen + 0.2)
    assert not at(seen + 0.3, drained=seen + 0.3 - GRACE - 0.01)
    # No consume started before the window runs into the due time.
    assert LEAD >= CONSUME_TIMEOUT_S
