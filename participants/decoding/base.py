"""The decoder interface: a source message's bytes and headers in, a record or a reason out.

A decoder never sees a sink and never sends a dead letter: :func:`write_batch` dead-letters what
it could not decode (:attr:`Decoded.bad`) and writes the rest. Every decoder shares the batch
scan -- per-partition summary, tombstones, the size limit -- so a new format writes one method,
:meth:`Decoder.decode_value`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from confluent_kafka import Message

from twophase.participants.sdk import RawBatch, Record

__all__ = ["Decoded", "Decoder", "Undecodable", "record_of"]

#: A Kafka message's headers, as confluent-kafka gives them.
Headers = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None] | None


@dataclass(frozen=True, slots=True)
class Undecodable:
    msg: Message
    reason: str


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
    decoder: Decoder

    def raw_batch(self) -> RawBatch:
        """The kept values for :meth:`Sink.write_raw`, decoding on demand."""
        kept = self.kept
        decode = self.decoder.decode_message
        return RawBatch(self.values, lambda i: decode(kept[i]))


#: ``Record(...)`` through its generated ``__new__`` costs ~0.2 us more per record than the
#: tuple constructor it calls (measured); the field order is Record's.
_new_tuple = tuple.__new__


def record_of(
    m: Message, topic: str, partition: int, offset: int, obj: dict[str, Any], n: int
) -> Record:
    """The record of message ``m`` whose value decoded to ``obj`` (``n`` bytes)."""
    ts = m.timestamp()[1]
    key = m.key()
    return _new_tuple(
        Record,
        (
            topic,
            partition,
            offset,
            # Kafka's value as it is: any int64 create time, -1 when the record has none.
            ts,
            key if key.__class__ is bytes else None,
            obj,
            (),
            n,
        ),
    )


class Decoder(ABC):
    """How one source format's values become records (``source.format`` picks it)."""

    #: The ``source.format`` value that picks this decoder.
    format: ClassVar[str]
    #: True when the values are JSON objects a sink may read itself (:meth:`Sink.write_raw`,
    #: the compiled COPY path): the batch is then scanned, not decoded.
    raw_values: ClassVar[bool] = False

    @abstractmethod
    def decode_value(self, value: bytes, headers: Headers) -> dict[str, Any] | str:
        """The record's fields, or why ``value`` is not a record of this format."""

    def decode_message(self, m: Message) -> Record | str:
        """One kept message decoded: its record, or why it is undecodable."""
        value = m.value() or b""
        obj = self.decode_value(value, m.headers())
        if isinstance(obj, str):
            return obj
        return record_of(m, m.topic() or "", m.partition() or 0, m.offset() or 0, obj, len(value))

    def decode_batch(
        self, msgs: Sequence[Message], max_record_bytes: int, decode: bool = True
    ) -> Decoded:
        """Records for what decodes; anything else is returned with the reason.

        ``decode=False`` (only for :attr:`raw_values` formats): only tombstones and oversize
        values are set aside; the rest are kept as bytes (for sinks that read them)."""
        scan = _Scan(self)
        for m in msgs:
            value = scan.admit(m, max_record_bytes)
            if value is None:
                continue
            if not decode:
                scan.keep(m, value)
                continue
            obj = self.decode_value(value, m.headers())
            if isinstance(obj, str):
                scan.bad.append(Undecodable(m, obj))
                continue
            scan.good.append(record_of(m, scan.topic, scan.partition, scan.offset, obj, len(value)))
            scan.count(len(value))
        return scan.done()


class _Scan:
    """The per-batch bookkeeping every decoder shares. Messages come in runs of one partition:
    the summary is updated once per run."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.good: list[Record] = []
        self.bad: list[Undecodable] = []
        self.kept: list[Message] = []
        self.values: list[bytes] = []
        self.last: dict[tuple[str, int], int] = {}
        self.counts: dict[tuple[str, int], int] = {}
        self.size = 0
        self.topic = ""
        self.partition = -1
        self.offset = 0
        self.run_last = -1
        self.run_good = 0

    def admit(self, m: Message, max_record_bytes: int) -> bytes | None:
        """``m``'s value when it is worth decoding; a tombstone or an oversize value is bad."""
        topic = m.topic() or ""
        partition = m.partition() or 0
        offset = self.offset = m.offset() or 0
        if partition != self.partition or topic != self.topic:
            self._merge()
            self.topic, self.partition, self.run_last, self.run_good = topic, partition, -1, 0
        if offset > self.run_last:
            self.run_last = offset
        value = m.value()
        if value is None:
            self.bad.append(Undecodable(m, "null value (tombstone): nothing to write"))
            return None
        if len(value) > max_record_bytes:
            self.bad.append(Undecodable(m, f"oversize: {len(value)} bytes > {max_record_bytes}"))
            return None
        return value

    def keep(self, m: Message, value: bytes) -> None:
        self.kept.append(m)
        self.values.append(value)
        self.count(len(value))

    def count(self, n: int) -> None:
        self.run_good += 1
        self.size += n

    def _merge(self) -> None:
        if self.partition < 0:
            return
        tp = (self.topic, self.partition)
        if self.run_last > self.last.get(tp, -1):
            self.last[tp] = self.run_last
        self.counts[tp] = self.counts.get(tp, 0) + self.run_good

    def done(self) -> Decoded:
        self._merge()
        return Decoded(
            self.good, self.bad, self.last, self.counts, self.size, self.kept, self.values,
            self.decoder,
        )  # fmt: skip
