"""The decoder interface: a source message's bytes and headers in, a record or a reason out.

A decoder never sees a sink and never sends a dead letter: :func:`write_batch` dead-letters what
it could not decode (:attr:`Decoded.bad`) and writes the rest. Every decoder shares the batch
scan -- per-partition summary, tombstones, the size limit -- and the source's options that do
not depend on the value's format (the record key's fields, the Kafka coordinates as fields,
what a tombstone means), so a new format writes one method, :meth:`Decoder.decode_value`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from confluent_kafka import Message

from twophase.config import SchemaRegistryConfig, SourceConfig
from twophase.participants.decoding.connect import ConnectError, unwrap
from twophase.participants.decoding.formats import ValueFormat, value_format
from twophase.participants.sdk import RawBatch, RawShape, Record, RecordSchema

__all__ = ["TOMBSTONE", "Decoded", "Decoder", "Row", "Undecodable", "oversize", "record_of"]

#: Why a null value (a tombstone) is set aside when the source does not delete with them.
TOMBSTONE = "null value (tombstone): nothing to write"


def oversize(n: int, limit: int) -> str:
    """Why a value of ``n`` bytes is set aside under ``participant.max_record_bytes`` ``limit``."""
    return f"oversize: {n} bytes > {limit}"


#: A Kafka message's headers, as confluent-kafka gives them.
Headers = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None] | None


@dataclass(frozen=True, slots=True)
class Row:
    """What :meth:`Decoder.decode_value` returns when a value says more than its fields: a
    delete (``fields`` are the deleted row's, at least its key's; a Debezium delete gives the
    whole row as it was), the value's schema, where the change came from (Debezium's
    ``source``). A plain dict is a row with none of these."""

    fields: dict[str, Any]
    deleted: bool = False
    schema: RecordSchema | None = None
    source: dict[str, Any] | None = None


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
        shape = self.decoder.raw_shape
        assert shape is not None  # only a raw decoder keeps values undecoded

        def coords(i: int) -> tuple[str, bytes | None]:
            m = kept[i]
            key = m.key()
            return m.topic() or "", key if key.__class__ is bytes else None

        return RawBatch(
            self.values,
            lambda i: decode(kept[i]),
            shape=shape,
            coords=coords,
            schemas=self.decoder.writer_schema,
        )


#: ``Record(...)`` through its generated ``__new__`` costs ~0.2 us more per record than the
#: tuple constructor it calls (measured); the field order is Record's.
_new_tuple = tuple.__new__


def record_of(
    m: Message,
    topic: str,
    partition: int,
    offset: int,
    obj: dict[str, Any],
    n: int,
    deleted: bool = False,
    schema: RecordSchema | None = None,
    source: dict[str, Any] | None = None,
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
            deleted,
            schema,
            source,
        ),
    )


class Decoder(ABC):
    """How one source's messages become records: its format's :meth:`decode_value`, and the
    source's options (``sources[]`` in the pipeline config) that apply to every format."""

    #: The ``source.format`` value that picks this decoder.
    format: ClassVar[str]
    #: What the values hold when a sink may read them itself (:meth:`Sink.write_raw`, the
    #: compiled COPY path; the batch is then scanned, not decoded), or None when they must be
    #: decoded here: a sink reading the bytes would not see what the source's options add.
    raw_shape: RawShape | None = None

    @property
    def raw_values(self) -> bool:
        """True when a sink may read the values itself (:attr:`raw_shape`)."""
        return self.raw_shape is not None

    def __init__(
        self, source: SourceConfig | None = None, registry: SchemaRegistryConfig | None = None
    ) -> None:
        source = source if source is not None else SourceConfig(topic="-")
        #: How the values' bytes decode (``value_format``); the decoder says what they mean.
        self.values: ValueFormat = value_format(source.value_format, registry)
        self.key_format = source.key_format
        self.keys = (
            value_format(source.key_format, registry) if self.key_json_like(source) else None
        )
        self.key_json = self.keys is not None
        self.key_field = source.key_field
        self.tombstones = source.tombstones or self.default_tombstones
        coords = source.kafka_fields
        self.kafka_fields = (
            [(f, name) for f, name in coords.model_dump().items() if name]
            if coords is not None
            else []
        )
        #: No option adds to what the message's value says.
        self.bare = not self.key_json and not self.kafka_fields and self.tombstones == "dead_letter"
        #: No option changes a record: the message's value is the whole record.
        self.plain = self.bare and source.value_format == "json"
        #: Equal for two sources whose messages this decoder treats alike.
        self.options: tuple[Any, ...] = (
            source.value_format,
            source.key_format,
            self.key_field,
            self.tombstones,
            tuple(self.kafka_fields),
        )
        #: A record of this source may be a delete (:attr:`Record.deleted`).
        self.deletes: bool = self.tombstones == "delete"
        #: (value schema id, key field names) -> the value schema naming its key.
        self._keyed: dict[tuple[str, tuple[str, ...]], RecordSchema] = {}

    def writer_schema(self, schema_id: int) -> str | None:
        """The Avro text of registry schema ``schema_id`` for a compiled reader, once a value
        of it was decoded here (:meth:`RawBatch.writer_schema`)."""
        return self.values.writer_schema(schema_id)

    @staticmethod
    def key_json_like(source: SourceConfig) -> bool:
        """The source's keys decode to fields (every ``key_format`` but ``none``)."""
        return source.key_format != "none"

    #: What a tombstone (a null value) means when ``sources[].tombstones`` does not say.
    default_tombstones: ClassVar[str] = "dead_letter"

    @abstractmethod
    def decode_value(
        self, value: bytes, headers: Headers, topic: str = ""
    ) -> dict[str, Any] | Row | str:
        """The record's fields (or a :class:`Row`: a delete, a schema, a source), or why
        ``value`` is not a record of this format. Decode the bytes with :attr:`values`."""

    def decode_message(self, m: Message) -> Record | str:
        """One kept message decoded: its record, or why it is undecodable."""
        return self.record(m, m.topic() or "", m.partition() or 0, m.offset() or 0, m.value())

    def record(
        self, m: Message, topic: str, partition: int, offset: int, value: bytes | None
    ) -> Record | str:
        """Message ``m`` (a tombstone when ``value`` is None) as a record, with the source's
        options applied, or why it cannot be one."""
        deleted = value is None
        schema = source = None
        if value is None:
            if self.tombstones != "delete":
                return TOMBSTONE
            fields: dict[str, Any] = {}
        else:
            obj = self.decode_value(value, m.headers(), topic)
            if obj.__class__ is str:
                return obj
            if obj.__class__ is Row:
                row: Row = obj
                deleted, schema, source = row.deleted, row.schema, row.source
                fields = row.fields
            else:
                fields = obj  # type: ignore[assignment]
        if self.key_json:
            key = self.key_fields(m.key(), topic)
            if key.__class__ is str:
                return key
            fields = {**fields, **key}  # type: ignore[dict-item]
            if schema is not None:
                schema = self._with_key(schema, tuple(key))
        elif deleted and not fields:
            return "tombstone: a delete needs the record key (sources[].key_format: json)"
        for coordinate, name in self.kafka_fields:
            fields[name] = _coordinate(m, coordinate, topic, partition, offset)
        return record_of(
            m, topic, partition, offset, fields, len(value or b""), deleted, schema, source
        )

    def key_fields(self, key: bytes | str | None, topic: str = "") -> dict[str, Any] | str:
        """The record key's fields (``key_format``): an object's fields, or a scalar as the
        field ``key_field``. ``json`` keys in a Kafka Connect ``{schema, payload}`` envelope
        are unwrapped."""
        if key is None:
            return f"key: missing (sources[].key_format is {self.key_format})"
        assert self.keys is not None
        got = self.keys.decode(key.encode() if isinstance(key, str) else key, topic, True)
        if isinstance(got, str):
            return f"key: {got.removeprefix('undecodable: ')}"
        obj = got[0]
        if self.key_format == "json":
            try:
                obj = unwrap(obj)
            except ConnectError as exc:
                return f"key: {exc}"
        if obj.__class__ is dict:
            return obj
        if self.key_field and (obj is None or obj.__class__ in (str, int, float, bool)):
            return {self.key_field: obj}
        return f"key: {type(obj).__name__}, expected an object (or set sources[].key_field)"

    def _with_key(self, schema: RecordSchema, names: tuple[str, ...]) -> RecordSchema:
        """``schema`` naming the record key's fields as its key (for a target's primary key)."""
        if schema.key == names:
            return schema
        known = self._keyed.get((schema.id, names))
        if known is None:
            known = RecordSchema(schema.fields, id=schema.id, name=schema.name, key=names)
            if len(self._keyed) >= 1024:
                self._keyed.clear()
            self._keyed[(schema.id, names)] = known
        return known

    def decode_batch(
        self, msgs: Sequence[Message], max_record_bytes: int, decode: bool = True
    ) -> Decoded:
        """Records for what decodes; anything else is returned with the reason.

        ``decode=False`` (only for :attr:`raw_shape` decoders): only tombstones and oversize
        values are set aside; the rest are kept as bytes (for sinks that read them)."""
        scan = _Scan(self)
        keep_tombstones = self.tombstones != "dead_letter"
        skip_tombstones = self.tombstones == "skip"
        for m in msgs:
            value = scan.admit(m, max_record_bytes, keep_tombstones)
            if value is None and (m.value() is not None or not keep_tombstones or skip_tombstones):
                continue  # set aside (oversize, a dead-lettered tombstone) or skipped
            if value is not None and not decode:
                scan.keep(m, value)
                continue
            rec = self.record(m, scan.topic, scan.partition, scan.offset, value)
            if rec.__class__ is str:
                scan.bad.append(Undecodable(m, rec))
                continue
            scan.good.append(rec)  # type: ignore[arg-type]
            scan.count(len(value or b""))
        return scan.done()


def _coordinate(m: Message, coordinate: str, topic: str, partition: int, offset: int) -> Any:
    if coordinate == "topic":
        return topic
    if coordinate == "partition":
        return partition
    if coordinate == "offset":
        return offset
    return m.timestamp()[1]


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

    def admit(
        self, m: Message, max_record_bytes: int, keep_tombstones: bool = False
    ) -> bytes | None:
        """``m``'s value when it is worth decoding; an oversize value is bad, and so is a
        tombstone unless the source keeps them (then None, and the caller looks again)."""
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
            if not keep_tombstones:
                self.bad.append(Undecodable(m, TOMBSTONE))
            return None
        if len(value) > max_record_bytes:
            self.bad.append(Undecodable(m, oversize(len(value), max_record_bytes)))
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
