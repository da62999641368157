"""``participants.runtime.gaps.UnreadStarts``: which first records after a seek count as
source offsets deleted unread, and how many (the e2e tests run it against a real broker:
tests/e2e/test_deleted_unread.py). The consumer here only answers the watermarks a fetch
would have cached."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from confluent_kafka import KafkaException, TopicPartition

from twophase.observability import Metrics
from twophase.participants.runtime.gaps import UnreadStarts

T = "orders"


@dataclass
class _Msg:
    t: str | None
    p: int | None
    o: int | None

    def topic(self) -> str | None:
        return self.t

    def partition(self) -> int | None:
        return self.p

    def offset(self) -> int | None:
        return self.o

    def error(self) -> None:
        return None


#: librdkafka's cached watermarks before any fetch of the partition (RD_KAFKA_OFFSET_INVALID).
UNKNOWN = (-1001, -1001)


class _Consumer:
    """Cached watermarks per partition, as librdkafka keeps them from its fetches (kept across
    seeks and rebalances; an error response stores the broker's -1)."""

    def __init__(self, marks: dict[int, tuple[int, int]], fail: bool = False) -> None:
        self.marks, self.fail = marks, fail

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool = False) -> tuple[int, int]:
        assert cached  # never a broker round trip on the data thread
        if self.fail:
            raise KafkaException("no metadata")
        return self.marks.get(tp.partition, UNKNOWN)


def _count(metrics: Metrics, partition: int) -> float:
    value = metrics.registry.get_sample_value(
        "twophase_source_offsets_deleted_unread_total",
        {"pipeline": "p", "topic": T, "partition": str(partition)},
    )
    return -1 if value is None else value


@pytest.mark.parametrize(
    ("sought", "first", "marks", "counted"),
    [
        (100, 100, (0, 500), 0),  # read on where sought
        (100, 101, (0, 500), 0),  # a commit marker or an aborted record at 100: nothing deleted
        (100, 160, (0, 500), 0),  # a hole (compaction, aborted transactions) above the log start
        (100, 150, (150, 500), 50),  # 100..149 deleted: the first record is the log start
        (100, 170, (150, 500), 50),  # deleted up to 149, then a hole: only the deleted count
        (100, 170, (200, 500), 70),  # the log start moved on past the first record: up to it
        (100, 101, (100, 500), 0),  # the log start at the sought offset: nothing deleted
        (100, 150, UNKNOWN, 0),  # no watermark known: nothing claimed
    ],
)
def test_what_counts_as_deleted_unread(
    sought: int,
    first: int,
    marks: tuple[int, int],
    counted: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    gaps.assigned([(T, 0)])
    consumer = _Consumer({})
    gaps.expect(consumer, {(T, 0): sought})
    consumer.marks[0] = marks  # the fetches after the seek
    with caplog.at_level(logging.WARNING, "twophase.participant"):
        gaps.check(consumer, [_Msg(T, 0, first), _Msg(T, 0, first + 1)])  # type: ignore[list-item]
    assert _count(metrics, 0) == counted
    lines = [r.getMessage() for r in caplog.records]
    if counted:
        assert lines == [
            f"{T}[0]: offsets {sought} to {sought + counted - 1} were deleted from the topic "
            f"(its retention, or DeleteRecords) before this pipeline delivered them; reading "
            f"goes on at {first}"
        ]
    else:
        assert lines == []
    # Only the first record after the seek is compared: a later jump is not another deletion.
    gaps.check(_Consumer({0: (10_000, 20_000)}), [_Msg(T, 0, 15_000)])  # type: ignore[list-item]
    assert _count(metrics, 0) == counted


def test_each_seek_is_watched_once_per_partition_and_logical_offsets_not_at_all() -> None:
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    gaps.assigned([(T, 0), (T, 1), (T, 2)])
    assert [_count(metrics, p) for p in (0, 1, 2)] == [0, 0, 0]  # shown from the assignment
    consumer = _Consumer({0: (50, 90), 1: (80, 90), 2: (0, 90)})
    gaps.expect(consumer, {(T, 0): 10, (T, 1): -2, (T, 2): 30})
    gaps.check(consumer, [_Msg(T, 1, 80), _Msg(None, None, None), _Msg(T, 0, 50)])  # type: ignore[list-item]
    assert [_count(metrics, p) for p in (0, 1, 2)] == [40, 0, 0]  # 1: OFFSET_BEGINNING
    gaps.expect(consumer, {(T, 0): 60})  # a rewind: watched again
    gaps.check(consumer, [_Msg(T, 2, 30), _Msg(T, 0, 60)])  # type: ignore[list-item]
    assert [_count(metrics, p) for p in (0, 1, 2)] == [40, 0, 0]


def test_a_partition_with_nothing_past_the_seek_stops_being_watched() -> None:
    """A fetch after the seek found the partition's end at the sought offset: no record will
    come to compare, and the other partitions' batches are not scanned for it."""
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    consumer = _Consumer({})
    gaps.expect(consumer, {(T, 0): 90})
    gaps.check(consumer, [])
    assert gaps._at  # no fetch yet
    consumer.marks[0] = (0, 90)
    gaps.check(consumer, [])
    assert not gaps._at


def test_a_restart_over_deleted_records_is_counted_whatever_the_fetches_cached_first() -> None:
    """A new process: nothing cached at the seek, then the out-of-range answer's -1, then the
    fetch from the log start."""
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    consumer = _Consumer({})
    gaps.expect(consumer, {(T, 0): 100})
    gaps.check(consumer, [])
    consumer.marks[0] = (-1, -1)
    gaps.check(consumer, [])
    consumer.marks[0] = (150, 500)
    gaps.check(consumer, [_Msg(T, 0, 150)])  # type: ignore[list-item]
    assert _count(metrics, 0) == 50


def test_a_partition_back_after_a_rebalance_is_watched_despite_its_old_cached_end() -> None:
    """The process read the partition before (its cached high watermark, 80, is from then);
    another owner committed up to 100 meanwhile, and retention then deleted up to 150. The
    cached end below the sought offset is old, not a fetch's answer: still watched."""
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    consumer = _Consumer({0: (0, 80)})
    gaps.expect(consumer, {(T, 0): 100})
    gaps.check(consumer, [])
    consumer.marks[0] = (150, 500)
    gaps.check(consumer, [_Msg(T, 0, 150)])  # type: ignore[list-item]
    assert _count(metrics, 0) == 50


def test_a_range_found_again_by_a_rewind_is_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until a commit passes the deleted range, each rewind goes back below the log start and
    finds it again: counted and logged once; a further deletion only for what is new."""
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    consumer = _Consumer({0: (150, 500)})
    with caplog.at_level(logging.WARNING, "twophase.participant"):
        for _ in range(3):
            gaps.expect(consumer, {(T, 0): 100})
            gaps.check(consumer, [_Msg(T, 0, 150)])  # type: ignore[list-item]
        assert _count(metrics, 0) == 50
        consumer.marks[0] = (170, 500)
        gaps.expect(consumer, {(T, 0): 100})
        gaps.check(consumer, [_Msg(T, 0, 170)])  # type: ignore[list-item]
    assert _count(metrics, 0) == 70
    assert [r.getMessage().split(" were")[0] for r in caplog.records] == [
        f"{T}[0]: offsets 100 to 149",
        f"{T}[0]: offsets 150 to 169",
    ]


def test_watermarks_that_cannot_be_read_are_no_deletion_and_raise_nothing() -> None:
    metrics = Metrics("p", "participant")
    gaps = UnreadStarts("p", metrics.deleted_unread)
    consumer = _Consumer({}, fail=True)
    gaps.expect(consumer, {(T, 0): 10})
    gaps.check(consumer, [_Msg(T, 0, 50)])  # type: ignore[list-item]
    assert _count(metrics, 0) == -1  # never counted (nor shown: no assignment here)
