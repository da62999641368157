"""The pieces of the SDK's BatchingSink that the built-in sinks stand on, without a store: the
prepare's error branches, the abandoned() hook, OpenSlot, and the marker's positions as JSON.
(The conformance kit checks the whole contract against real stores.)"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import pytest

from twophase.participants.sdk import (
    AbortTransactionError,
    BatchingSink,
    OpenSlot,
    PartId,
    PartMarker,
    PartState,
    Record,
    Rejected,
    RetriableSinkError,
    SinkConfig,
    SinkContext,
    positions_from_json,
    positions_to_json,
)


class _MemorySink(BatchingSink):
    """Markers in a dict; the prepared marker fails with ``fail_prepare`` while it is set."""

    def __init__(self, participant: str = "w1") -> None:
        super().__init__(
            SinkConfig(name="mem", type="mem"),
            SinkContext("p", participant, "mem", logging.getLogger("test.mem")),
        )
        self.markers: dict[PartId, PartMarker] = {}
        self.fail_prepare: Exception | None = None
        self.dead_writers: set[PartId] = set()

    def setup(self) -> None:
        pass

    def stage(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        return []

    def publish(self, part: PartId) -> None:
        marker = self.markers.get(part)
        if marker is not None and marker.state == "prepared":
            self.markers[part] = PartMarker(part, "committed", marker.positions, marker.records)

    def discard(self, part: PartId) -> None:
        marker = self.markers.get(part)
        if marker is not None and marker.state != "committed":
            self.markers[part] = PartMarker(part, "aborted")

    def save_marker(self, marker: PartMarker, *, expect: Collection[PartState | None]) -> bool:
        if marker.state == "prepared" and self.fail_prepare is not None:
            raise self.fail_prepare
        current = self.markers.get(marker.part)
        if (current.state if current else None) not in expect:
            return False
        self.markers[marker.part] = marker
        return True

    def load_marker(self, part: PartId) -> PartMarker | None:
        return self.markers.get(part)

    def list_parts(self, state: PartState) -> list[PartId]:
        return [p for p, m in self.markers.items() if m.state == state]


class _LockedSink(_MemorySink):
    def abandoned(self, part: PartId, before_txn: int) -> bool:
        return part in self.dead_writers


def _part(txn: int, participant: str = "w1") -> PartId:
    return PartId("p", txn, participant)


def test_a_prepare_that_fails_for_good_loses_the_part() -> None:
    sink = _MemorySink()
    sink.begin(_part(1))
    sink.fail_prepare = OSError("the disk went away half-way through")
    with pytest.raises(OSError):
        sink.prepare(_part(1), {("t", 0): 1})
    sink.fail_prepare = None
    with pytest.raises(AbortTransactionError, match="can only be aborted"):
        sink.prepare(_part(1), {("t", 0): 1})  # never prepared on top of half a prepare
    sink.abort(_part(1))
    assert sink.markers[_part(1)].state == "aborted"


def test_a_prepare_that_fails_retriably_is_repeated() -> None:
    sink = _MemorySink()
    sink.begin(_part(1))
    sink.fail_prepare = RetriableSinkError("busy", sink="mem")
    with pytest.raises(RetriableSinkError):
        sink.prepare(_part(1), {("t", 0): 1})
    sink.fail_prepare = None
    sink.prepare(_part(1), {("t", 0): 1})
    assert sink.markers[_part(1)].state == "prepared"


def test_stale_parts_ask_abandoned_and_never_list_the_own_open_part() -> None:
    sink = _MemorySink()
    sink.markers[_part(3, "w2")] = PartMarker(_part(3, "w2"), "open")
    sink.markers[_part(7, "w2")] = PartMarker(_part(7, "w2"), "open")
    sink.begin(_part(5))
    assert sink.stale_parts(5) == [_part(3, "w2")]  # the default: older than the bound
    assert sink.stale_parts(100) == [_part(3, "w2"), _part(7, "w2")]

    locked = _LockedSink()
    locked.markers = dict(sink.markers)
    locked.dead_writers = {_part(7, "w2"), _part(5)}
    assert locked.stale_parts(0) == [_part(5), _part(7, "w2")]  # the hook, not the bound
    locked.begin(_part(9))
    locked.markers[_part(9)] = PartMarker(_part(9), "open")
    locked.dead_writers.add(_part(9))
    assert _part(9) not in locked.stale_parts(0)  # never this process's own open part


def test_open_slot_holds_one_part_and_gives_it_once() -> None:
    slot: OpenSlot[list[int]] = OpenSlot()
    assert slot.held() is None and slot.get(_part(1)) is None
    buffers = [1, 2]
    slot.put(_part(1), buffers)
    assert slot.get(_part(2)) is None  # another part's: nothing
    assert slot.get(_part(1)) is buffers
    assert slot.held() == (_part(1), buffers)
    assert slot.get(_part(1), take=True) is buffers
    assert slot.get(_part(1)) is None and slot.held() is None


def test_positions_round_trip_sorted_and_repeats_keep_the_highest() -> None:
    positions = {("b", 1): 7, ("a", 0): 3, ("a", 2): 10**18}
    stored = positions_to_json(positions)
    assert [(p["topic"], p["partition"]) for p in stored] == [("a", 0), ("a", 2), ("b", 1)]
    assert positions_from_json(stored) == positions
    assert positions_to_json(dict(reversed(positions.items()))) == stored
    repeated = [*stored, {"topic": "a", "partition": 0, "offset": 2}]
    assert positions_from_json(repeated)[("a", 0)] == 3
    with pytest.raises(ValueError):
        positions_from_json({"a": 1})
    with pytest.raises(KeyError):
        positions_from_json([{"topic": "a", "partition": 0}])
