"""Decoding source records, and the dead-letter topic for the ones no sink can take.

A dead-lettered record counts as handled inside the transaction that met it: its offset is
covered by the part's vote, and the DLQ write is flushed before the vote goes out, so it is never
lost. If that transaction aborts, the record is read and dead-lettered again: the DLQ is
at-least-once, keyed by the source coordinates (``topic:partition:offset``) so a reader can
de-duplicate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, Message, Producer

from participants.sdk import RawBatch, Record
from twophase.errors import RetriableError
from twophase.observability import txn_extra

__all__ = ["DeadLetters", "Decoded", "decode_batch", "decode_message", "message_key"]

H_REASON = "twophase.reason"
log = logging.getLogger("twophase.participant")


@dataclass(frozen=True, slots=True)
class Undecodable:
    msg: Message
    reason: str


def message_key(m: Message) -> bytes | None:
    key = m.key()
    return key if isinstance(key, bytes) else None


@dataclass(slots=True)
class Decoded:
    """One consumed batch, decoded: the records, what could not be decoded, and per source
    partition the highest offset read and how many records decoded (counted in the same pass,
    so the caller never walks the batch again).

    Scanned without decoding (``decode_batch(..., decode=False)``), ``records`` is empty and
    ``kept``/``values`` hold the messages that passed the size and tombstone checks and their
    values, counted as decoded until a :class:`RawBatch` finds otherwise."""

    records: list[Record]
    bad: list[Undecodable]
    last: dict[tuple[str, int], int]
    counts: dict[tuple[str, int], int]
    #: Bytes of the decoded records' values.
    size: int
    kept: list[Message]
    values: list[bytes]

    def raw_batch(self) -> RawBatch:
        """The kept values for :meth:`Sink.write_raw`, decoding on demand."""
        kept = self.kept
        return RawBatch(self.values, lambda i: decode_message(kept[i]))


#: ``Record(...)`` through its generated ``__new__`` costs ~0.2 us more per record than the
#: tuple constructor it calls (measured); the field order is Record's.
_new_tuple = tuple.__new__


def _record(
    m: Message, topic: str, partition: int, offset: int, obj: dict[str, Any], n: int
) -> Record:
    ts = m.timestamp()[1]
    key = m.key()
    return _new_tuple(
        Record,
        (
            topic,
            partition,
            offset,
            ts if ts and ts > 0 else 0,
            key if key.__class__ is bytes else None,
            obj,
            (),
            n,
        ),
    )


#: orjson decodes an integer outside -2**63 .. 2**64-1 as the nearest double:
#: 18446744073709551617 would become 1.8446744073709552e+19. Any such double is at least this
#: large; a decoded value holding one is decoded again by the standard library, which keeps
#: every integer exact (a float literal this large is decoded again too, to the same value).
#: Looking costs ~0.3 us for a flat ~200-byte record (a regex over the bytes cost ~1.5 us).
_WIDE = 9.2e18


def _maybe_wide(obj: dict[str, Any]) -> bool:
    """True when ``obj`` (orjson's decoding) holds a double that may be a rounded integer."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        for v in item.values() if item.__class__ is dict else item:
            kind = v.__class__
            if kind is float:
                if v >= _WIDE or v <= -_WIDE:
                    return True
            elif kind is dict or kind is list:
                stack.append(v)
    return False


def _exact(value: bytes, obj: Any) -> Any:
    """``obj`` (orjson's decoding of ``value``, so strict JSON) with integers of any size kept
    exact, or a str saying why it cannot be."""
    if not _maybe_wide(obj):
        return obj
    try:
        return json.loads(value)
    except RecursionError:
        return "undecodable: nested too deeply"
    except ValueError as exc:  # an integer past the interpreter's digit limit
        return f"undecodable: {exc}"


def _not_an_object(value: bytes) -> tuple[dict[str, Any] | None, str]:
    """The decoded object, or None and why the value is not one."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return None, f"undecodable: not JSON ({exc})"
    if obj.__class__ is not dict:
        return None, f"undecodable: JSON {type(obj).__name__}, expected an object"
    obj = _exact(value, obj)
    if obj.__class__ is str:
        return None, obj
    return obj, ""


def decode_message(m: Message) -> Record | str:
    """One kept message decoded: its record, or why it is undecodable."""
    value = m.value() or b""
    obj, reason = _not_an_object(value)
    if obj is None:
        return reason
    return _record(m, m.topic() or "", m.partition() or 0, m.offset() or 0, obj, len(value))


def decode_batch(msgs: Sequence[Message], max_record_bytes: int, decode: bool = True) -> Decoded:
    """JSON objects become :class:`Record`; anything else is returned with the reason.

    ``decode=False``: only tombstones and oversize values are set aside; the rest are kept
    as bytes (for sinks that read JSON themselves)."""
    good: list[Record] = []
    bad: list[Undecodable] = []
    kept: list[Message] = []
    values: list[bytes] = []
    last: dict[tuple[str, int], int] = {}
    counts: dict[tuple[str, int], int] = {}
    size = 0
    loads = orjson.loads
    wide = _maybe_wide
    append = good.append
    # Messages come in runs of one partition: the summary is updated once per run.
    run_topic = ""
    run_partition = -1
    run_last = -1
    run_good = 0
    for m in msgs:
        topic = m.topic() or ""
        partition = m.partition() or 0
        offset = m.offset() or 0
        if partition != run_partition or topic != run_topic:
            if run_partition >= 0:
                _merge_run(last, counts, (run_topic, run_partition), run_last, run_good)
            run_topic, run_partition, run_last, run_good = topic, partition, -1, 0
        if offset > run_last:
            run_last = offset
        value = m.value()
        if value is None:
            bad.append(Undecodable(m, "null value (tombstone): nothing to write"))
            continue
        n = len(value)
        if n > max_record_bytes:
            bad.append(Undecodable(m, f"oversize: {n} bytes > {max_record_bytes}"))
            continue
        if not decode:
            kept.append(m)
            values.append(value)
            run_good += 1
            size += n
            continue
        try:
            obj = loads(value)
        except orjson.JSONDecodeError:
            obj = None
        if obj.__class__ is dict and wide(obj):
            obj = _exact(value, obj)
        if obj.__class__ is not dict:
            bad.append(Undecodable(m, _not_an_object(value)[1]))
            continue
        append(_record(m, topic, partition, offset, obj, n))
        run_good += 1
        size += n
    if run_partition >= 0:
        _merge_run(last, counts, (run_topic, run_partition), run_last, run_good)
    return Decoded(good, bad, last, counts, size, kept, values)


def _merge_run(
    last: dict[tuple[str, int], int],
    counts: dict[tuple[str, int], int],
    tp: tuple[str, int],
    run_last: int,
    run_good: int,
) -> None:
    if run_last > last.get(tp, -1):
        last[tp] = run_last
    counts[tp] = counts.get(tp, 0) + run_good


class DeadLetters:
    """Produces rejected records to the DLQ with the reason and source coordinates in headers."""

    def __init__(
        self,
        producer: Producer,
        topic: str,
        pipeline: str,
        participant: str,
        on_sent: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.on_sent = on_sent
        self.producer = producer
        self.topic = topic
        self.pipeline = pipeline
        self.participant = participant
        self._errors: list[KafkaError] = []

    def send(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        reason: str,
        txn: int,
        sink: str = "",
    ) -> None:
        headers = [
            (H_REASON, reason.encode()[:4000]),
            ("twophase.pipeline", self.pipeline.encode()),
            ("twophase.participant", self.participant.encode()),
            ("twophase.txn", str(txn).encode()),
            ("twophase.source.topic", topic.encode()),
            ("twophase.source.partition", str(partition).encode()),
            ("twophase.source.offset", str(offset).encode()),
            ("twophase.source.key", key or b""),
        ]
        if sink:
            headers.append(("twophase.sink", sink.encode()))
        self.producer.produce(
            self.topic,
            value=value,
            key=f"{topic}:{partition}:{offset}".encode(),
            headers=headers,  # type: ignore[arg-type]
            on_delivery=self._on_delivery,
        )
        self.producer.poll(0)
        self.on_sent(reason)
        log.warning(
            "txn=%s dead-lettered %s[%s]@%s: %s",
            txn,
            topic,
            partition,
            offset,
            reason,
            extra=txn_extra(
                txn, [(topic, partition)], pipeline=self.pipeline, participant=self.participant
            ),
        )

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._errors.append(err)

    def flush(self, timeout_s: float) -> None:
        """Before a vote: every dead letter of the part is durable, or the prepare fails."""
        if self.producer.flush(timeout_s) > 0:
            raise RetriableError(f"dead letters not delivered within {timeout_s}s")
        if self._errors:
            err, self._errors = self._errors[0], []
            raise RetriableError(f"dead letter not delivered: {err.str()}")
