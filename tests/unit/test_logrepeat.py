"""Collapsing librdkafka's repeated lines (twophase/logrepeat.py): the pure logic and the filter."""

from __future__ import annotations

import logging

from twophase.logrepeat import CollapseRepeats, RepeatCollapser, repeat_key

REFUSED = (
    "FAIL [twophase-demo-consumer#consumer-{c}] [thrd:127.0.0.1:{port}/{b}]: 127.0.0.1:{port}/{b}: "
    "Connect to ipv4#127.0.0.1:{port} failed: Connection refused (after {ms}ms in state CONNECT)"
)


def refused(c: int = 1, b: str = "1", ms: int = 0, port: int = 9092) -> str:
    return REFUSED.format(c=c, b=b, ms=ms, port=port)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _record(text: str) -> logging.LogRecord:
    return logging.LogRecord("twophase.librdkafka", logging.WARNING, __file__, 1, text, None, None)


def test_lines_from_other_clients_and_with_other_numbers_are_repeats() -> None:
    a = repeat_key("l", logging.WARNING, refused(c=1, ms=0))
    assert a == repeat_key("l", logging.WARNING, refused(c=7, ms=312))
    assert a[2] == "127.0.0.1:9092/1"


def test_other_brokers_levels_and_messages_are_not_repeats() -> None:
    a = repeat_key("l", logging.WARNING, refused(b="1"))
    assert a != repeat_key("l", logging.WARNING, refused(b="bootstrap"))
    assert a != repeat_key("l", logging.WARNING, refused(port=9093))
    assert a != repeat_key("l", logging.ERROR, refused())
    assert a != repeat_key("l", logging.WARNING, refused().replace("refused", "reset by peer"))


def test_one_line_per_interval_then_a_count() -> None:
    c = RepeatCollapser(interval_s=10)
    key = repeat_key("l", logging.WARNING, refused())
    admitted = [c.admit(key, _record(refused(ms=i)), 100 + i * 0.01) for i in range(500)]
    assert admitted[0] == 0 and admitted[1:] == [None] * 499
    assert c.due(109.9) == []
    assert c.next_due() == 110
    [summary] = c.due(110.0)
    assert summary.count == 499 and summary.span_s == 10
    assert summary.last.getMessage() == refused(ms=499)
    assert c.due(200) == [] and c.next_due() is None
    # The next interval starts with a line logged again, with nothing to report.
    assert c.admit(key, _record(refused()), 200) == 0


def test_a_line_after_the_interval_carries_the_count_of_the_one_before() -> None:
    c = RepeatCollapser(interval_s=10)
    key = repeat_key("l", logging.WARNING, refused())
    assert c.admit(key, _record(refused()), 100) == 0
    for i in range(40):
        assert c.admit(key, _record(refused(ms=i)), 100.5 + i * 0.2) is None
    assert c.admit(key, _record(refused()), 110.5) == 40
    assert c.due(110.5) == []  # counted once, on that line
    assert c.admit(key, _record(refused()), 111) is None


def test_a_line_without_repeats_leaves_no_summary_and_no_state() -> None:
    c = RepeatCollapser(interval_s=10)
    assert c.admit(("l", 30, "", "x"), _record("x"), 0) == 0
    assert c.due(11) == [] and c.next_due() is None


def test_the_filter_logs_first_lines_and_summaries_through_the_same_logger() -> None:
    clock = FakeClock()
    flt = CollapseRepeats(interval_s=10, clock=clock)
    logger = logging.getLogger("twophase.librdkafka.test-collapse")
    logger.propagate = False
    capture = Capture()
    logger.handlers[:] = [capture]
    logger.setLevel(logging.INFO)
    logger.addFilter(flt)
    try:
        for i in range(300):  # thousands of lines in a restart, from several clients
            logger.warning("%s", refused(c=i % 5, ms=i))
            logger.warning("%s", refused(c=i % 5, b="bootstrap", ms=i))
            clock.now += 0.01
        assert capture.lines == [refused(c=0, ms=0), refused(c=0, b="bootstrap", ms=0)]
        clock.now += 10
        flt.flush()  # what the timer does when no further line comes
        assert capture.lines[2:] == [
            f"{refused(c=4, ms=299)} (x 299 more like this in the last 10 s)",
            f"{refused(c=4, b='bootstrap', ms=299)} (x 299 more like this in the last 10 s)",
        ]
        clock.now = 5000.0  # exact steps of 0.25 s from here
        logger.warning("%s", refused(ms=1))
        assert capture.lines[-1] == refused(ms=1)
        assert len(capture.lines) == 5
        # An outage that lasts: one line per interval, each with the count of the one before.
        for k in range(1, 101):
            clock.now = 5000.0 + k * 0.25
            logger.warning("%s", refused(c=k % 3, ms=k))
        assert capture.lines[5:] == [
            f"{refused(c=1, ms=40)} (x 39 more like this in the last 10 s)",
            f"{refused(c=2, ms=80)} (x 39 more like this in the last 10 s)",
        ]
    finally:
        logger.removeFilter(flt)


def test_the_filter_leaves_other_records_alone() -> None:
    clock = FakeClock()
    flt = CollapseRepeats(interval_s=10, applies=lambda r: r.msg == "Kafka: %s", clock=clock)
    other = _record("committed txn 3")
    assert all(flt.filter(other) for _ in range(5))
    first = logging.LogRecord(
        "twophase.kafka", logging.WARNING, __file__, 1, "Kafka: %s", ("down",), None
    )
    assert flt.filter(first) and not flt.filter(first)
    clock.now += 10
    assert flt.filter(first) and first.getMessage().endswith(
        "(x 1 more like this in the last 10 s)"
    )
