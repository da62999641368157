"""Stalled source partitions: records are waiting, and no commit has moved the partition's
position for ``commit.stall_alarm_s``.

The cycle alarm (``commit.max_failed_cycles``) only counts failed cycles. A pipeline can also
commit every cycle and still not move: a participant that votes but no longer reads (a stuck
sink call, a bug) makes every part it sends empty, and the lag grows behind a row of successful
commits (seen in a chaos run). The leading coordinator knows both halves -- the positions its
commits cover and, from Kafka, where each partition ends -- so it watches for that here.

Pure: the runtime feeds it the time, the decision log's positions and the partitions' ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["StallReport", "StallWatch"]

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class StallReport:
    #: Per partition: seconds since its position last moved while records wait (0: none wait).
    stalled_s: dict[TopicPartition, float]
    #: Partitions stalled for at least the alarm time.
    alarmed: frozenset[TopicPartition]
    #: Partitions that crossed into / out of the alarm with this observation.
    raised: frozenset[TopicPartition]
    cleared: frozenset[TopicPartition]


@dataclass
class StallWatch:
    alarm_after_s: float
    #: When each partition's position was last seen to move (or first seen at all).
    _moved_at: dict[TopicPartition, float] = field(default_factory=dict)
    _position: dict[TopicPartition, int] = field(default_factory=dict)
    _alarmed: frozenset[TopicPartition] = frozenset()
    #: The latest observation; None before the first and after :meth:`reset`.
    last: StallReport | None = None

    def observe(
        self,
        now_s: float,
        positions: Mapping[TopicPartition, int],
        ends: Mapping[TopicPartition, int],
    ) -> StallReport:
        """``positions``: next offset to read per partition, as the committed decisions say
        (the runtime gives a partition nothing has committed yet its earliest offset, where
        reading starts). ``ends``: each partition's end (the last stable offset, as a
        read_committed consumer sees it). A partition without a known end is left out."""
        stalled: dict[TopicPartition, float] = {}
        for tp, end in ends.items():
            position = positions.get(tp, 0)
            waiting = end > position
            if not waiting or tp not in self._moved_at or position != self._position.get(tp):
                # Caught up counts as moving: the clock starts when records begin to wait.
                self._moved_at[tp] = now_s
                self._position[tp] = position
            stalled[tp] = round(now_s - self._moved_at[tp], 3)
        for tp in list(self._moved_at):
            if tp not in ends:  # a partition no longer read (topic deleted, say)
                del self._moved_at[tp]
                self._position.pop(tp, None)
        alarmed = frozenset(tp for tp, s in stalled.items() if s >= self.alarm_after_s)
        report = StallReport(
            stalled,
            alarmed,
            raised=alarmed - self._alarmed,
            cleared=self._alarmed - alarmed,
        )
        self._alarmed = alarmed
        self.last = report
        return report

    def reset(self) -> None:
        """Forget everything (leadership lost: the next leader starts its own clock)."""
        self._moved_at.clear()
        self._position.clear()
        self._alarmed = frozenset()
        self.last = None
