"""Source records deleted before the pipeline read them.

A participant resumes a partition from its committed position. When the topic's retention (or
an operator's DeleteRecords) has removed records from there on, the broker answers that the
offset is out of range and the consumer starts again at the partition's log start
(``auto.offset.reset`` = earliest): the records in between are gone, and the part that goes on
from the committed position covers them without holding them. librdkafka says so only in its own
log. :class:`UnreadStarts` tells it in the participant's log, naming the partition and the
offsets, and counts them (``twophase_source_offsets_deleted_unread``), so an alarm can fire.

A first record past the sought offset is not a deletion by itself -- the markers of a
transactional producer and the records of aborted transactions take offsets a ``read_committed``
consumer never sees, and compaction leaves holes -- so only offsets below the partition's log
start (the low watermark the fetch reported) are counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

__all__ = ["UnreadStarts"]

log = logging.getLogger("twophase.participant")


class UnreadStarts:
    """Where each source partition was last sought to, until its first record comes."""

    def __init__(self, pipeline: str, counter: Any) -> None:
        self.pipeline = pipeline
        #: ``twophase_source_offsets_deleted_unread`` (labels pipeline, topic, partition).
        self.counter = counter
        self._at: dict[tuple[str, int], int] = {}

    def expect(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Reading starts again at ``offsets`` (logical offsets, below 0, are not watched)."""
        for tp, offset in offsets.items():
            if offset >= 0:
                self._at[tp] = offset
            else:
                self._at.pop(tp, None)

    def clear(self) -> None:
        self._at.clear()

    def check(self, consumer: Consumer, msgs: Sequence[Message]) -> None:
        """Compare each watched partition's first record in ``msgs`` with where it was sought."""
        if not self._at:
            return
        for m in msgs:
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            if topic is None or partition is None or offset is None:
                continue  # not a record (an event without coordinates)
            tp = (topic, partition)
            at = self._at.pop(tp, None)
            if at is None or offset <= at:
                continue
            marks = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
            low = marks[0] if marks else -1
            if low <= at:
                continue  # markers, aborted records or compaction: nothing was deleted unread
            gone = min(low, offset) - at
            self.counter.labels(self.pipeline, tp[0], str(tp[1])).inc(gone)
            log.warning(
                "%s[%d]: offsets %d to %d were deleted from the topic (its retention, or "
                "DeleteRecords) before this pipeline read them; reading goes on at %d",
                tp[0],
                tp[1],
                at,
                at + gone - 1,
                offset,
                extra={"pipeline": self.pipeline, "topic": tp[0], "partition": tp[1]},
            )
