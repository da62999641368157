"""The participant's per-batch bookkeeping: decoding, dead letters, and the per-partition summary
(highest offset read, records written, records dead-lettered) that the vote's positions and
counts come from. Counted in the decoding pass, so it is checked here against batches whose
partitions come in interleaved runs, with bad records at the ends of runs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import orjson
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from twophase.observability import Metrics
from twophase.participants.decoding import JsonDecoder
from twophase.participants.runtime.batch import Retractions, close_quietly, write_batch
from twophase.participants.runtime.deadletter import DeadLetters
from twophase.participants.sdk import (
    AbortTransactionError,
    Held,
    PartId,
    RawBatch,
    RawShape,
    Record,
    Rejected,
    Sink,
    SinkConfig,
    SinkError,
)

JSON = JsonDecoder()
decode_batch = JSON.decode_batch
decode_message = JSON.decode_message


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
    """A sink that refuses records whose id is in ``refuse`` and keeps the rest; with
    ``checks`` it says so in check() too (as built-in sinks do for their own rules)."""

    def __init__(
        self,
        name: str,
        refuse: set[int],
        twice: bool = False,
        checks: bool = True,
        topics: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.config = SinkConfig(name=name, type="test", topics=topics)
        self.refuse = refuse
        self.twice = twice
        self.checks = checks
        self.got: list[Record] = []

    def check(self, records: Sequence[Record]) -> list[Rejected]:
        if not self.checks:
            return []
        return [Rejected(r, "no") for r in records if r.value["id"] in self.refuse]

    def accepts_raw(self) -> bool:
        return False

    def accepts_raw_shape(self, shape: RawShape) -> bool:
        return Sink.accepts_raw_shape(self, shape)  # type: ignore[arg-type]

    def write(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        out = [Rejected(r, "no") for r in records if r.value["id"] in self.refuse]
        self.got.extend(r for r in records if r.value["id"] not in self.refuse)
        return out + out if self.twice else out


class _RawRefusing(_Refusing):
    """The same, reading the values itself: every value through ``batch.record`` (as a sink
    does with the values it cannot take on its own)."""

    def accepts_raw(self) -> bool:
        return True

    def write_raw(self, part: PartId, batch: RawBatch) -> list[Rejected]:
        records = [r for i in range(len(batch)) if (r := batch.record(i)) is not None]
        return self.write(part, records)


@pytest.mark.parametrize("raw", [False, True], ids=["decoded-here", "sinks-read-raw"])
def test_write_batch_counts_written_and_dead_per_partition(raw: bool) -> None:
    """Whoever decodes, the same records are written, dead-lettered with the same reasons,
    counted and measured alike."""
    sink = _RawRefusing if raw else _Refusing
    first = sink("pg", {5}, twice=True)  # naming a record twice must not count it twice
    second = sink("files", {11})
    dlq = _Dlq()
    metrics = Metrics("p", "participant")
    result = write_batch(
        BATCH,
        PartId("p", 3, "w1"),
        cast(list[Sink], [first, second]),
        dlq=cast(DeadLetters, dlq),
        metrics=metrics,
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert result.result == {
        # (highest offset read, written, dead-lettered)
        ("orders", 0): (13, 1, 3),  # 10 written; 12, 13 undecodable; 11 refused by files
        ("orders", 1): (8, 1, 3),  # 8 written; 6, 7 undecodable; 5 refused by pg
        ("refunds", 0): (14, 1, 0),
    }
    # 11, refused by the second sink's check, reached no sink; 5, refused by the first sink's
    # write, was never offered to the second.
    assert [r.offset for r in first.got] == [10, 8, 14]
    assert [r.offset for r in second.got] == [10, 8, 14]
    reasons = sorted((s["offset"], s["reason"]) for s in dlq.sent)
    assert [o for o, _ in reasons] == [5, 6, 7, 11, 12, 13]
    assert dict(reasons)[5] == "rejected by sink pg: no"
    assert dict(reasons)[11] == "rejected by sink files: no"
    sizes = {r.offset: r.size for r in decode_batch(BATCH, 64).records}
    written = metrics.registry.get_sample_value
    assert written("twophase_sink_records_total", {"pipeline": "p", "sink": "pg"}) == 3
    assert written("twophase_sink_records_total", {"pipeline": "p", "sink": "files"}) == 3
    assert written("twophase_sink_bytes_total", {"pipeline": "p", "sink": "pg"}) == sum(
        sizes[o] for o in (10, 8, 14)
    )
    assert written("twophase_sink_bytes_total", {"pipeline": "p", "sink": "files"}) == sum(
        sizes[o] for o in (10, 8, 14)
    )


@pytest.mark.parametrize("raw", [False, True], ids=["decoded-here", "sinks-read-raw"])
def test_a_later_sinks_write_refusal_is_retracted_by_a_rewind(raw: bool) -> None:
    """A record the second sink refuses only at write time is already in the first: the batch
    fails (the caller rewinds), and the re-read leaves the record out of every sink, counted
    as dead-lettered and dead-lettered again with the same reason (the first letter may not have
    been delivered: the DLQ is at-least-once by key)."""
    sink = _RawRefusing if raw else _Refusing
    dlq = _Dlq()
    retractions = Retractions()

    def run() -> tuple[Any, Any, Any]:
        first, second = sink("pg", set()), sink("mongo", {11}, checks=False)
        result = write_batch(
            BATCH,
            PartId("p", 3, "w1"),
            cast(list[Sink], [first, second]),
            dlq=cast(DeadLetters, dlq),
            metrics=Metrics("p", "participant"),
            decoder=JSON,
            max_record_bytes=64,
            retry=lambda fn, what: fn(),
            retractions=retractions,
        )
        return result, first, second

    with pytest.raises(AbortTransactionError, match="refused by sink mongo"):
        run()
    assert retractions.reason("orders", 0, 11) == "rejected by sink mongo: no"
    assert [s["reason"] for s in dlq.sent if s["offset"] == 11] == ["rejected by sink mongo: no"]
    result, first, second = run()  # the re-read of the part
    assert [r.offset for r in first.got] == [r.offset for r in second.got] == [10, 5, 8, 14]
    assert result.result[("orders", 0)] == (13, 1, 3)  # 11 counted as dead-lettered
    assert [s["reason"] for s in dlq.sent if s["offset"] == 11] == [
        "rejected by sink mongo: no"
    ] * 2  # sent again by the try whose flush the vote waits for
    retractions.prune({("orders", 0): 12})
    assert len(retractions) == 0


def test_retractions_are_bounded() -> None:
    r = Retractions(limit=2)
    for offset in range(3):
        r.add("t", 0, offset, "x")
    assert len(r) == 2 and r.reason("t", 0, 0) is None and r.reason("t", 0, 2) == "x"


def test_write_batch_decodes_only_for_sinks_that_do_not_read_raw() -> None:
    """One sink that needs records: the batch is decoded once for all, write_raw never called."""
    raw = _RawRefusing("pg", set())
    plain = _Refusing("files", set())
    called: list[str] = []
    raw.write_raw = lambda part, batch: called.append("raw") or []  # type: ignore[method-assign]
    write_batch(
        BATCH,
        PartId("p", 3, "w1"),
        cast(list[Sink], [raw, plain]),
        dlq=cast(DeadLetters, _Dlq()),
        metrics=Metrics("p", "participant"),
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert called == [] and [r.offset for r in raw.got] == [10, 11, 5, 8, 14]


def test_raw_batch_decodes_each_value_once_and_views_share_it() -> None:
    values = [b'{"id": 1}', b"[1]", b'{"id": 3}', b"nope"]
    decoded: list[int] = []

    def decode(i: int) -> Record | str:
        decoded.append(i)
        obj = orjson.loads(values[i]) if values[i] != b"nope" else None
        if not isinstance(obj, dict):
            return f"undecodable {i}"
        return Record("t", 0, i, 0, None, obj, (), len(values[i]))

    batch = RawBatch(values, decode)
    assert [r.offset for r in batch.records()] == [0, 2]
    assert batch.record(1) is None and batch.record(2) is not None
    assert decoded == [0, 1, 2, 3]  # once each, however often asked
    rest = batch.without({"t:0:0"})
    assert rest.values == [b"[1]", b'{"id": 3}', b"nope"]
    assert [r.offset for r in rest.records()] == [2]  # offsets stay those of the first batch
    assert rest.undecodable() == batch.undecodable() == {1: "undecodable 1", 3: "undecodable 3"}
    assert decoded == [0, 1, 2, 3]


def test_raw_batch_topics_and_keys_in_one_pass_are_each_values() -> None:
    """``topics()``/``keys()`` say what ``topic(i)``/``key(i)`` say, for a batch that knows its
    messages and one that does not, and for views of it (a subset, a batch without some)."""
    msgs = [msg(i % 3, i, {"id": i}, topic=f"t{i % 4}") for i in range(40)] + [
        Message(topic="t9", partition=0, offset=99, key=None, value=b'{"id": 99}')
    ]
    decoded = JsonDecoder().decode_batch(msgs, 1 << 20, decode=False)
    with_messages = decoded.raw_batch().with_messages(decoded.kept)
    for batch in (decoded.raw_batch(), with_messages):
        views = [
            batch,
            batch.subset([40, 3, 17, 0, 5]),
            batch.subset(range(0, 41, 2)).subset([1, 0, 7]),
            batch.without({"t1:1:1", "t3:0:3"}),
        ]
        for view in views:
            assert view.topics() == [view.topic(i) for i in range(len(view))]
            assert view.keys() == [view.key(i) for i in range(len(view))]
    assert with_messages.subset([40, 3]).keys() == [None, b"3"]
    assert with_messages.subset([40, 3]).topics() == ["t9", "t3"]


@pytest.mark.parametrize(
    "text",
    [
        b'{"i": 18446744073709551617}',
        b'{"i": -9223372036854775809, "j": 1.5}',
        b'{"a": [{"b": 100000000000000000000000000000}]}',
        b'{"f": 1e19, "s": "12345678901234567890123"}',
    ],
)
def test_integers_of_any_width_decode_exactly(text: bytes) -> None:
    """orjson alone rounds an integer outside -2**63..2**64-1 to a double (#14)."""
    import json

    m = msg(0, 1, text)
    [got] = decode_batch([m], max_record_bytes=1000).records
    assert got.value == json.loads(text)
    one = decode_message(m)
    assert isinstance(one, Record) and one.value == json.loads(text)
    assert repr(got.value) == repr(json.loads(text))  # 1e19 stays a float, ints stay ints


@pytest.mark.parametrize("raw", [False, True], ids=["decoded-here", "sinks-read-raw"])
def test_each_sink_gets_only_the_topics_it_takes_and_a_topic_none_takes_is_dead_lettered(
    raw: bool,
) -> None:
    sink = _RawRefusing if raw else _Refusing
    orders = sink("pg", set(), topics=("orders",))
    every = sink("files", set(), topics=("orders|refunds",))
    refunds = sink("mongo", {14}, topics=("ref.*", "nothing"))
    batch = [*BATCH, msg(0, 3, {"id": 3}, topic="returns"), msg(0, 15, {"id": 15}, topic="refunds")]
    dlq = _Dlq()
    ordered = cast(list[Sink], [orders, every, refunds])
    result = write_batch(
        batch,
        PartId("p", 3, "w1"),
        ordered,
        dlq=cast(DeadLetters, dlq),
        metrics=Metrics("p", "participant"),
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert [(r.topic, r.offset) for r in orders.got] == [
        ("orders", 10),
        ("orders", 11),
        ("orders", 5),
        ("orders", 8),
    ]
    assert [(r.topic, r.offset) for r in refunds.got] == [("refunds", 15)]
    # 14, refused by mongo's check, reaches no sink; "returns" is nobody's: dead-lettered
    assert [(r.topic, r.offset) for r in every.got] == [
        ("orders", 10), ("orders", 11), ("orders", 5), ("orders", 8), ("refunds", 15)
    ]  # fmt: skip
    reasons = {(s["topic"], s["offset"]): s["reason"] for s in dlq.sent}
    assert reasons[("returns", 3)] == "no sink takes topic returns (sinks[].topics)"
    assert reasons[("refunds", 14)] == "rejected by sink mongo: no"
    assert result.result[("returns", 0)] == (3, 0, 1)  # its position moves on: nothing is lost


class _Targeting(_Refusing):
    """A sink that makes its targets: it holds records whose id is in ``hold`` for a later
    part and refuses those in ``never`` (an incompatible schema change)."""

    def __init__(self, name: str, hold: set[int], never: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(name, set())
        self.hold, self.never = hold, never
        self.asked: list[int] = []

    def open_targets(self, part: PartId, records: Sequence[Record]) -> list[Rejected | Held]:
        self.asked = [r.offset for r in records]
        out: list[Rejected | Held] = [
            Held(r, "busy") for r in records if r.value["id"] in self.hold
        ]
        return out + [Rejected(r, "incompatible") for r in records if r.value["id"] in self.never]


def test_a_held_record_ends_its_partitions_part_there_and_nothing_after_it_is_judged() -> None:
    """A record a sink holds for a later part is written by no sink, and neither is anything
    after it on its partition -- not even what would be dead-lettered (it is read again, and
    judged, for the next part); other partitions go on; what a sink refuses before the held
    record is dead-lettered as usual."""
    batch = [
        msg(0, 10, {"id": 10}),
        msg(1, 5, {"id": 5}),
        msg(0, 11, {"id": 11}),  # refused by the targeting sink: dead-lettered
        msg(0, 12, {"id": 12}),  # held: partition 0 ends before 12 in this part
        msg(1, 6, {"id": 6}),
        msg(0, 13, b"{not json"),  # after the held record: not dead-lettered now
        msg(0, 14, {"id": 14}),  # after the held record: not written
        msg(1, 7, {"id": 7}),
        msg(0, 15, {"id": 15}),  # a second held record of the same partition: 12 stands
    ]
    first = _Refusing("pg", set())
    second = _Targeting("files", hold={12, 15}, never={11})
    dlq = _Dlq()
    out = write_batch(
        batch,
        PartId("p", 3, "w1"),
        cast(list[Sink], [first, second]),
        dlq=cast(DeadLetters, dlq),
        metrics=Metrics("p", "participant"),
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert out.held == {("orders", 0): 12}
    assert [r.offset for r in first.got] == [r.offset for r in second.got] == [10, 5, 6, 7]
    assert sorted(second.asked) == [5, 6, 7, 10, 11, 12, 14, 15]
    assert [(s["offset"], s["reason"]) for s in dlq.sent] == [
        (11, "rejected by sink files: incompatible")
    ]
    assert out.result == {
        ("orders", 0): (11, 1, 1),  # the part ends before 12: 10 written, 11 dead-lettered
        ("orders", 1): (7, 3, 0),
    }


def test_a_record_held_at_the_start_of_the_batch_moves_nothing() -> None:
    second = _Targeting("files", hold={10})
    out = write_batch(
        [msg(0, 10, {"id": 10}), msg(0, 11, {"id": 11})],
        PartId("p", 3, "w1"),
        cast(list[Sink], [_Refusing("pg", set()), second]),
        dlq=cast(DeadLetters, _Dlq()),
        metrics=Metrics("p", "participant"),
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert out.held == {("orders", 0): 10}
    assert out.result == {("orders", 0): (9, 0, 0)}  # the next part starts at 10
    assert second.got == []


def test_a_sink_that_makes_no_targets_as_configured_is_not_asked() -> None:
    """Sink.makes_targets: a sink with an open_targets of its own that says it has nothing to
    make (postgres without auto_create/auto_evolve) is not asked, and keeps its raw path."""

    class _Idle(_Targeting):
        makes_targets = False

    idle = _Idle("pg", hold={10})
    out = write_batch(
        [msg(0, 10, {"id": 10})],
        PartId("p", 3, "w1"),
        cast(list[Sink], [idle]),
        dlq=cast(DeadLetters, _Dlq()),
        metrics=Metrics("p", "participant"),
        decoder=JSON,
        max_record_bytes=64,
        retry=lambda fn, what: fn(),
    )
    assert out.held == {} and idle.asked == []
    assert [r.offset for r in idle.got] == [10]


class _ClosingSink:
    def __init__(self, name: str, fails: bool, closed: list[str]) -> None:
        self.name, self.fails, self.closed = name, fails, closed

    def close(self) -> None:
        if self.fails:
            raise OSError(f"{self.name} cannot close")
        self.closed.append(self.name)


def test_close_quietly_closes_the_rest_when_one_fails(caplog: pytest.LogCaptureFixture) -> None:
    """However a run ended, every client and sink gets its close: a closer that raises -- a
    Kafka error, a callback's error as a consumer closes, a sink's -- is logged and what follows
    it still runs; the first error that is not Kafka's own comes back for the caller to raise."""
    closed: list[str] = []
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g"})
    consumer.close()

    def fenced() -> None:
        raise KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))

    def revoke_failed() -> None:
        raise SinkError("abort on revoke failed")

    # A closed consumer's calls raise RuntimeError; a fenced producer's flush, KafkaException.
    closers = [consumer.assignment, fenced, revoke_failed, lambda: closed.append("producer")]
    sinks = [_ClosingSink("first", True, closed), _ClosingSink("second", False, closed)]
    with caplog.at_level(logging.INFO, logger="twophase.participant"):
        failed = close_quietly(closers, cast(Any, sinks))
    assert closed == ["producer", "second"]
    assert isinstance(failed, SinkError) and "abort on revoke" in str(failed)
    assert "Consumer closed" in caplog.text and "fenced" in caplog.text
    assert "closing sink first: first cannot close" in caplog.text
    assert close_quietly([], cast(Any, sinks[1:])) is None
