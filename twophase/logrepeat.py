"""Collapse librdkafka's repeated lines: one line per broker and kind of message per interval.

While a broker is down every client of a process reports every failed connect -- through its
log and its ``error_cb`` -- a few times a second: a Kafka restart once produced thousands of
``Connection refused`` lines in 16 s across five processes. Here the first such line of an
interval is logged as it comes; the repeats within the interval are only counted. The first
line after the interval says how many there were (``... (x 212 more like this in the last
10 s)``) and starts the next interval, so a lasting outage costs one line per interval; when
no such line comes, a timer logs the count on its own. Every line is stamped when it is logged.

Lines are "the same" when they come from the same logger at the same level about the same
broker and differ only in numbers and in which client or librdkafka thread reported them.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["REPEAT_INTERVAL_S", "CollapseRepeats", "RepeatCollapser", "Summary", "repeat_key"]

#: librdkafka retries a broker connection at most every ``reconnect.backoff.max.ms`` (10 s by
#: default), so an outage still shows up once per retry round, and a restart of a few seconds
#: costs a line or two per broker.
REPEAT_INTERVAL_S = 10.0

# "127.0.0.1:9092/1", "127.0.0.1:9092/bootstrap", "sasl_ssl://kafka-0.kafka:9093/0"
_BROKER = re.compile(r"(?:[a-z_]+://)?[\w.\-]+:\d+/(?:\d+|bootstrap)")
# "[twophase-orders-consumer#consumer-2]", "[rdkafka#producer-1]", "[thrd:127.0.0.1:9092/1]:"
_CLIENT = re.compile(r"\[[^\]\s]*#(?:producer|consumer)-\d+\]")
_THREAD = re.compile(r"\[thrd:[^\]]*\]:?")
_NUMBER = re.compile(r"\d+")

Key = tuple[str, int, str, str]


def repeat_key(logger: str, level: int, text: str) -> Key:
    """What makes two lines repeats of each other: logger, level, broker, and the text without
    its numbers, client name and thread name."""
    m = _BROKER.search(text)
    broker = m.group(0) if m else ""
    rest = _BROKER.sub("<broker>", _THREAD.sub("", _CLIENT.sub("", text)))
    return logger, level, broker, _NUMBER.sub("#", rest).strip()


@dataclass
class _Window:
    started: float
    suppressed: int = 0
    last: logging.LogRecord | None = None


@dataclass(frozen=True)
class Summary:
    """The repeats of one interval: how many, over how long, and the last of them."""

    count: int
    span_s: float
    last: logging.LogRecord


class RepeatCollapser:
    """Which lines to log now and which to count; no I/O, no clock of its own."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._windows: dict[Key, _Window] = {}

    def admit(self, key: Key, record: logging.LogRecord, now: float) -> int | None:
        """None: ``record`` is a repeat, counted. A number: log ``record`` now, as the first of
        its kind in a new interval, saying that many repeats of the interval before it."""
        window = self._windows.get(key)
        if window is None or now - window.started >= self.interval_s:
            self._windows[key] = _Window(started=now)
            return window.suppressed if window is not None else 0
        window.suppressed += 1
        window.last = record
        return None

    def due(self, now: float) -> list[Summary]:
        """Windows that ended with repeats, as summaries, oldest first; ended windows without
        repeats are forgotten (memory stays bounded by the kinds seen in one interval)."""
        out: list[tuple[float, Summary]] = []
        for key, window in list(self._windows.items()):
            if now - window.started < self.interval_s:
                continue
            del self._windows[key]
            if window.suppressed and window.last is not None:
                summary = Summary(window.suppressed, self.interval_s, window.last)
                out.append((window.started, summary))
        return [summary for _, summary in sorted(out, key=lambda item: item[0])]

    def next_due(self) -> float | None:
        """When the earliest window with repeats ends (to flush it if no more lines come)."""
        ends = [w.started + self.interval_s for w in self._windows.values() if w.suppressed]
        return min(ends) if ends else None


class CollapseRepeats(logging.Filter):
    """A logger filter applying :class:`RepeatCollapser` to the records ``applies`` selects.

    The count of an interval rides on the next line of its kind; when none comes, it is logged
    on a line of its own (by the next line of another kind, or a timer), through the logger of
    the lines it counts.
    """

    def __init__(
        self,
        interval_s: float = REPEAT_INTERVAL_S,
        applies: Callable[[logging.LogRecord], bool] = lambda record: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._collapser = RepeatCollapser(interval_s)
        self._applies = applies
        self._clock = clock
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "repeats", None) is not None or not self._applies(record):
            return True
        key = repeat_key(record.name, record.levelno, record.getMessage())
        with self._lock:
            now = self._clock()
            # This key's own ended window first: its count rides on this record.
            repeats = self._collapser.admit(key, record, now)
            summaries = self._collapser.due(now)
            self._arm_timer_locked(now)
        _log_summaries(summaries)
        if repeats is None:
            return False
        if repeats:
            record.msg = _with_count(record.getMessage(), repeats, self._collapser.interval_s)
            record.args = ()
            record.repeats = repeats
        return True

    def flush(self) -> None:
        """Log the summaries of every interval that has ended."""
        with self._lock:
            now = self._clock()
            self._timer = None
            summaries = self._collapser.due(now)
            self._arm_timer_locked(now)
        _log_summaries(summaries)

    def _arm_timer_locked(self, now: float) -> None:
        if self._timer is not None:
            return
        due = self._collapser.next_due()
        if due is None:
            return
        # A second after the end: a line that keeps coming is usually back by then and carries
        # the count itself (one line instead of two).
        self._timer = threading.Timer(max(0.0, due - now) + _TIMER_LAG_S, self.flush)
        self._timer.daemon = True
        self._timer.start()


_TIMER_LAG_S = 1.0


def _with_count(message: str, repeats: int, span_s: float) -> str:
    return f"{message} (x {repeats} more like this in the last {span_s:.0f} s)"


def _log_summaries(summaries: list[Summary]) -> None:
    for s in summaries:
        logging.getLogger(s.last.name).log(
            s.last.levelno,
            "%s",
            _with_count(s.last.getMessage(), s.count, s.span_s),
            extra={"repeats": s.count},
        )
