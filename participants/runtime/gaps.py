"""Source records deleted before the pipeline delivered them.

A participant resumes a partition from its committed position (after a start, a rebalance or a
rewind). When the topic's retention (or an operator's DeleteRecords) has removed records from
there on, the broker answers that the offset is out of range and the consumer starts again at
the partition's log start (``auto.offset.reset`` = earliest): the records in between are gone,
and the part that goes on from the committed position covers them without holding them.
librdkafka says so only in its own log. :class:`UnreadStarts` tells it in the participant's
log, naming the partition and the offsets, and counts them
(``twophase_source_offsets_deleted_unread``).

A first record past the sought offset is not a deletion by itself -- the markers of a
transactional producer and the records of aborted transactions take offsets a ``read_committed``
consumer never sees, and compaction leaves holes -- so only offsets below the partition's log
start (the low watermark the fetch reported) are counted, each range once per process. On a
transactional topic some of those may have been markers or aborted records: the count is an
upper bound of the records lost.

Not seen here: a participant that keeps reading while retention overtakes it (librdkafka
resets its position without a seek of ours).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

__all__ = ["UnreadStarts"]

log = logging.getLogger("twophase.participant")


class UnreadStarts:
    """Where each source partition was last sought to, until its first record comes."""

    def __init__(self, pipeline: str, counter: Any) -> None:
        self.pipeline = pipeline
        #: ``twophase_source_offsets_deleted_unread`` (labels pipeline, topic, partition).
        self.counter = counter
        #: Per watched partition: the sought offset, and its cached high watermark then.
        self._at: dict[tuple[str, int], tuple[int, int]] = {}
        #: Per partition, the end of the last range counted: a rewind before a commit passes
        #: it finds the same range deleted again, and it is not counted twice.
        self._counted: dict[tuple[str, int], int] = {}

    def assigned(self, tps: Iterable[tuple[str, int]]) -> None:
        """Show each assigned partition's series at 0 from the assignment on (an alert on a
        value above 0 then sees every series; one on an increase sees later counts)."""
        for topic, partition in tps:
            self.counter.labels(self.pipeline, topic, str(partition))

    def expect(self, consumer: Consumer, offsets: Mapping[tuple[str, int], int]) -> None:
        """Reading starts again at ``offsets`` (logical offsets, below 0, are not watched)."""
        for tp, offset in offsets.items():
            if offset >= 0:
                self._at[tp] = (offset, self._marks(consumer, tp)[1])
            else:
                self._at.pop(tp, None)

    def clear(self) -> None:
        self._at.clear()

    def check(self, consumer: Consumer, msgs: Sequence[Message]) -> None:
        """Compare each watched partition's first record in ``msgs`` (of partitions still
        read; error events are passed over) with where it was sought."""
        if not self._at:
            return
        for tp, (sought, then) in list(self._at.items()):
            # A fetch since the seek (the cached high watermark moved: librdkafka keeps the
            # last one across seeks and rebalances) found nothing past the sought offset: no
            # record will come to compare, and nothing there was deleted unread.
            high = self._marks(consumer, tp)[1]
            if 0 <= high <= sought and high != then:
                del self._at[tp]
        for m in msgs:
            if not self._at:
                break
            if m.error() is not None:
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            if topic is None or partition is None or offset is None:
                continue  # not a record (an event without coordinates)
            tp = (topic, partition)
            watched = self._at.pop(tp, None)
            if watched is None or offset <= watched[0]:
                continue
            low = self._marks(consumer, tp)[0]
            start = max(watched[0], self._counted.get(tp, -1))
            end = min(low, offset)
            if end <= start:
                continue  # markers, aborted records, compaction, or a range counted already
            self._counted[tp] = end
            self.counter.labels(self.pipeline, topic, str(partition)).inc(end - start)
            log.warning(
                "%s[%d]: offsets %d to %d were deleted from the topic (its retention, or "
                "DeleteRecords) before this pipeline delivered them; reading goes on at %d",
                topic,
                partition,
                start,
                end - 1,
                offset,
                extra={"pipeline": self.pipeline, "topic": topic, "partition": partition},
            )

    @staticmethod
    def _marks(consumer: Consumer, tp: tuple[str, int]) -> tuple[int, int]:
        """The partition's low and high watermarks as the last fetch reported them (below 0:
        not known). Never raises: a metric must not end the data thread."""
        try:
            marks = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
        except KafkaException:
            return -1, -1
        return (marks[0], marks[1]) if marks else (-1, -1)
