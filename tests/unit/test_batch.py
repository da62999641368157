"""The participant's per-batch bookkeeping: decoding, dead letters, and the per-partition summary
(highest offset read, records written, records dead-lettered) that the vote's positions and
counts come from. Counted in the decoding pass, so it is checked here against batches whose
partitions come in interleaved runs, with bad records at the ends of runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import orjson
from confluent_kafka import Message

from participants.runtime.batch import write_batch
from participants.runtime.deadletter import DeadLetters, decode_batch
from participants.sdk import PartId, Record, Rejected, Sink
from twophase.observability import Metrics


def msg(partition: int, offset: int, value: Any, topic: str = "orders") -> Message:
    raw = value if value is None or isinstance(value, bytes) else orjson.dumps(value)
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        key=str(offset).encode(),
        value=raw,
        timestamp=(1, 1_700_000_000_000 + offset),
    )


BATCH = [
    msg(0, 10, {"id": 10}),
    msg(0, 11, {"id": 11}),
    msg(1, 5, {"id": 5}),
    msg(0, 12, b"{not json"),
    msg(1, 6, None),  # tombstone
    msg(0, 13, [1, 2]),  # JSON, not an object
    msg(1, 7, {"id": 7, "pad": "x" * 100}),  # oversize below
    msg(1, 8, {"id": 8}),
    msg(0, 14, {"id": 14}, topic="refunds"),
]


def test_decode_batch_summarises_every_partition_in_one_pass() -> None:
    d = decode_batch(BATCH, max_record_bytes=64)
    assert [(r.topic, r.partition, r.offset) for r in d.records] == [
        ("orders", 0, 10),
        ("orders", 0, 11),
        ("orders", 1, 5),
        ("orders", 1, 8),
        ("refunds", 0, 14),
    ]
    first = d.records[0]
    assert first == Record("orders", 0, 10, 1_700_000_000_010, b"10", {"id": 10}, (), 9)
    assert [(u.msg.offset(), u.reason.split(":")[0]) for u in d.bad] == [
        (12, "undecodable"),
        (6, "null value (tombstone)"),
        (13, "undecodable"),
        (7, "oversize"),
    ]
    assert "expected an object" in d.bad[2].reason
    # Bad records count for the highest offset read (their offsets are handled), not as decoded.
    assert d.last == {("orders", 0): 13, ("orders", 1): 8, ("refunds", 0): 14}
    assert d.counts == {("orders", 0): 2, ("orders", 1): 2, ("refunds", 0): 1}
    assert d.size == sum(r.size for r in d.records)


def test_decode_batch_of_nothing() -> None:
    d = decode_batch([], max_record_bytes=64)
    assert (d.records, d.bad, d.last, d.counts, d.size) == ([], [], {}, {}, 0)


class _Dlq:
    """Records what would be dead-lettered (DeadLetters' own Kafka path is tested end to end)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, **kw: Any) -> None:
        self.sent.append(kw)


class _Refusing:
    """A sink that refuses records whose id is in ``refuse`` and keeps the rest."""

    def __init__(self, name: str, refuse: set[int], twice: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.twice = twice
        self.got: list[Record] = []

    def write(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        out = [Rejected(r, "no") for r in records if r.value["id"] in self.refuse]
        self.got.extend(r for r in records if r.value["id"] not in self.refuse)
        return out + out if self.twice else out


def test_write_batch_counts_written_and_dead_per_partition() -> None:
    first = _Refusing("pg", {5}, twice=True)  # naming a record twice must not count it twice
    second = _Refusing("files", {11})
    dlq = _Dlq()
    metrics = Metrics("p", "participant")
    result = write_batch(
        BATCH,
        PartId("p", 3, "w1"),
        cast(list[Sink], [first, second]),
        dlq=cast(DeadLetters, dlq),
        metrics=metrics,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert result == {
        # (highest offset read, written, dead-lettered)
        ("orders", 0): (13, 1, 3),  # 10 written; 12, 13 undecodable; 11 refused by files
        ("orders", 1): (8, 1, 3),  # 8 written; 6, 7 undecodable; 5 refused by pg
        ("refunds", 0): (14, 1, 0),
    }
    assert [r.offset for r in first.got] == [10, 11, 8, 14]
    assert [r.offset for r in second.got] == [10, 8, 14]  # never offered what pg refused
    reasons = sorted((s["offset"], s["reason"]) for s in dlq.sent)
    assert [o for o, _ in reasons] == [5, 6, 7, 11, 12, 13]
    assert dict(reasons)[5] == "rejected by sink pg: no"
    assert dict(reasons)[11] == "rejected by sink files: no"
    sizes = {r.offset: r.size for r in decode_batch(BATCH, 64).records}
    written = metrics.registry.get_sample_value
    assert written("twophase_sink_records_total", {"pipeline": "p", "sink": "pg"}) == 4
    assert written("twophase_sink_records_total", {"pipeline": "p", "sink": "files"}) == 3
    assert written("twophase_sink_bytes_total", {"pipeline": "p", "sink": "pg"}) == sum(
        sizes[o] for o in (10, 11, 8, 14)
    )
    assert written("twophase_sink_bytes_total", {"pipeline": "p", "sink": "files"}) == sum(
        sizes[o] for o in (10, 8, 14)
    )
