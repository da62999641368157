"""``twophase.kafka.bounded``: a call that ignores its own timeout (librdkafka's
``send_offsets_to_transaction`` while the group coordinator moves, librdkafka #5456) must not
hold the caller past the bound."""

from __future__ import annotations

import threading
import time

import pytest

from twophase.kafka import Wedged, bounded


def test_a_call_that_returns_gives_its_result() -> None:
    assert bounded(lambda: 41 + 1, 5.0, "sum") == 42


def test_a_call_that_raises_raises_in_the_caller() -> None:
    def boom() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        bounded(boom, 5.0, "boom")


def test_a_call_that_does_not_return_is_left_behind_at_the_bound() -> None:
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(Wedged, match="stuck did not return within"):
        bounded(lambda: release.wait(30), 0.3, "stuck")
    assert time.monotonic() - started < 5
    release.set()  # the abandoned call ends on its own thread
