"""Typed values that cross the SDK boundary: records, transaction parts and rejections."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from twophase.participants.sdk.schema import RecordSchema

__all__ = [
    "CommittedInfo",
    "Held",
    "PartId",
    "Positions",
    "AVRO",
    "PLAIN_JSON",
    "RawBatch",
    "RawShape",
    "Record",
    "Rejected",
    "TopicPartition",
]

TopicPartition = tuple[str, int]
#: Next offset to consume, per source partition: what a committed part has fully handled.
Positions = Mapping[TopicPartition, int]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Record(NamedTuple):
    """One source record, decoded. ``value`` is the JSON object from the record's value (with
    what the source's options add: the key's fields, the Kafka coordinates).

    Immutable. A named tuple rather than a frozen dataclass because one is built per source
    record on the hot path, and a frozen dataclass costs ~1.4 us more to build (measured: a
    fifth of the participant's per-record work before any sink runs).
    """

    topic: str
    partition: int
    offset: int
    #: Kafka's timestamp as it is (any int64; -1 when the record has none).
    timestamp_ms: int
    key: bytes | None
    value: dict[str, Any]
    headers: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    #: A delete: ``value`` holds the deleted row's fields (at least its key's). Only a sink
    #: that declares ``supports_deletes`` is given one (a pipeline whose sources can delete
    #: fails at start-up otherwise); it removes the row of that key in the same part.
    deleted: bool = False
    #: The value's schema, when its source has one (a registry format, a Kafka Connect
    #: envelope): what each field's type is, for a sink that creates or evolves its target
    #: from it (:mod:`twophase.participants.sdk.schema`). None for schemaless JSON.
    schema: RecordSchema | None = None
    #: Where a change came from, when its source says: Debezium's ``source`` block (``table``,
    #: ``schema``, ``db``, ``lsn``, ...). A target template reads it (``${source.table}``).
    source: Mapping[str, Any] | None = None

    @property
    def record_id(self) -> str:
        """Deterministic id from the source coordinates: the same record always gets the same id."""
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass(frozen=True, slots=True, order=True)
class PartId:
    """One participant's share of coordinator transaction ``txn`` in ``pipeline``.

    A sink stores parts under :attr:`token`, which is short, stable across processes, and can be
    parsed back with :meth:`parse` when a restarted process lists its in-doubt parts.
    """

    pipeline: str
    txn: int
    participant: str

    def __post_init__(self) -> None:
        for name in ("pipeline", "participant"):
            value = getattr(self, name)
            if not _NAME.match(value) or len(value) > 64:
                raise ValueError(f"{name} {value!r}: use 1-64 of [A-Za-z0-9_.-]")
        if self.txn < 0:
            raise ValueError(f"txn must be >= 0, got {self.txn}")

    @property
    def token(self) -> str:
        """``pipeline~txn~participant``; ``~`` never occurs in a name, so parsing is exact."""
        return f"{self.pipeline}~{self.txn:012d}~{self.participant}"

    @classmethod
    def parse(cls, token: str) -> PartId:
        pipeline, txn, participant = token.split("~")
        return cls(pipeline, int(txn), participant)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record the sink will not store, with the reason. The runtime dead-letters it.

    ``extra`` goes into the dead letter's headers. Standard keys, used when the sink knows them:
    ``field`` (the value's field at fault, dotted when nested), ``column`` (the store's column or
    attribute), ``sqlstate`` (the SQL server's error code). Values are strings.
    """

    record: Record
    reason: str
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Held:
    """A record whose target cannot take it in this part, but will in a later one: a table
    another participant is changing, a lock that is not free now (:meth:`Sink.open_targets`).

    The runtime writes it -- and every later record of its partition in the batch -- into no
    sink now: the part ends before it on that partition, and the record is read again for the
    next part. Per-partition order is kept; nothing is dead-lettered.
    """

    record: Record
    reason: str


@dataclass(frozen=True, slots=True)
class CommittedInfo:
    """The newest committed part of a pipeline in one sink (:meth:`Sink.last_committed`).

    ``part`` names the transaction and the participant whose part it is (a transaction has one
    part per participant that wrote; any of them stands for it). ``committed_at`` is when the
    store recorded the commit, timezone-aware and converted to UTC; None when the store does not
    keep it.
    """

    part: PartId
    committed_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.committed_at is not None:
            if self.committed_at.utcoffset() is None:
                raise ValueError("committed_at must be timezone-aware (a naive time is ambiguous)")
            object.__setattr__(self, "committed_at", self.committed_at.astimezone(UTC))

    @property
    def txn(self) -> int:
        return self.part.txn


@dataclass(frozen=True, slots=True)
class RawShape:
    """What the values of a :class:`RawBatch` hold, and how a record comes out of one.

    ``envelope`` None: each value is the record's JSON object. ``"debezium"``: each value is a
    Debezium change event in schemaless JSON (``{before, after, op, source, ...}``); a sink
    may store the ``after`` row of an event whose ``op`` is ``c``, ``r`` or ``u`` and must ask
    :meth:`RawBatch.record` for every other value (deletes among them). ``key_fields``: the
    record key (:meth:`RawBatch.key`, a JSON object) overlays the row's fields, its values
    winning (``sources[].key_format: json``).
    """

    envelope: str | None = None
    key_fields: bool = False
    #: ``"json"``, or ``"avro"``: each value is in the schema registry's framing (magic byte 0,
    #: a 4-byte schema id, the Avro datum of a record); :meth:`RawBatch.writer_schema` gives
    #: the schema's text once the runtime knows it.
    format: str = "json"


#: The raw values of a plain JSON source: every value is the record.
PLAIN_JSON = RawShape()
#: The raw values of an Avro source (``value_format: avro``) with no options: every value is
#: the record, in the registry's framing.
AVRO = RawShape(format="avro")


class RawBatch:
    """One consumed batch with its values not yet decoded, for :meth:`Sink.write_raw`.

    ``values[i]`` is record i's value as it came from the source, in the batch's
    :attr:`shape` (never a tombstone, never over ``participant.max_record_bytes``);
    :meth:`topic` and :meth:`key` are its message's topic and key. A sink that reads them
    itself stores each value or asks :meth:`record` for it; :meth:`record` decodes once and
    returns None for a value that is no record -- the runtime dead-letters those (with the
    same reason as when records are decoded first) and the sink skips them.
    """

    __slots__ = (
        "_coords", "_decode", "_decoded", "_ids", "_index", "_messages", "_schemas", "shape",
        "values",
    )  # fmt: skip

    def __init__(
        self,
        values: list[bytes],
        decode: Callable[[int], Record | str],
        _decoded: dict[int, Record | str] | None = None,
        _index: Sequence[int] | None = None,
        *,
        shape: RawShape = PLAIN_JSON,
        coords: Callable[[int], tuple[str, bytes | None]] | None = None,
        schemas: Callable[[int], str | None] | None = None,
        messages: Sequence[Any] | None = None,
    ) -> None:
        self.values = values
        self._decode = decode
        #: Shared by every view of one batch: each value is decoded at most once.
        self._decoded: dict[int, Record | str] = {} if _decoded is None else _decoded
        #: Position of each value in the batch it was first built from.
        self._index: Sequence[int] = range(len(values)) if _index is None else _index
        self._ids: dict[str, int] | None = None
        self.shape = shape
        #: Position in the first batch -> the message's (topic, key).
        self._coords = coords
        self._schemas = schemas
        #: The first batch's messages (``topic()``, ``partition()``, ``offset()``,
        #: ``timestamp()``), for :meth:`origins`.
        self._messages = messages

    def with_messages(self, messages: Sequence[Any]) -> RawBatch:
        """This batch knowing its values' messages (the first batch's, in order)."""
        return RawBatch(
            self.values,
            self._decode,
            self._decoded,
            self._index,
            shape=self.shape,
            coords=self._coords,
            schemas=self._schemas,
            messages=messages,
        )

    def origins(
        self, *, positions: bool = True
    ) -> tuple[list[str], list[int], list[int], list[int]] | None:
        """Per value, its message's topic, partition, offset and timestamp (ms, as
        :attr:`Record.timestamp_ms`), without decoding; None when the batch does not know its
        messages (a sink then decodes, or asks :meth:`record`). ``positions`` False: the
        partitions and offsets are left out (empty lists)."""
        if self._messages is None:
            return None
        index, msgs = self._index, self._messages
        if index != range(len(msgs)):
            msgs = [msgs[at] for at in index]
        return (
            [m.topic() or "" for m in msgs],
            [m.partition() or 0 for m in msgs] if positions else [],
            [m.offset() or 0 for m in msgs] if positions else [],
            [m.timestamp()[1] for m in msgs],
        )

    def known_undecodable(self) -> list[int]:
        """Positions (in this batch) of the values found not to be records so far (by an
        earlier sink's :meth:`record`), which a sink skips without asking again."""
        if not self._decoded:
            return []
        bad = self.undecodable()
        return [i for i, at in enumerate(self._index) if at in bad] if bad else []

    def writer_schema(self, schema_id: int) -> str | None:
        """The Avro text of registry schema ``schema_id`` (``RawShape.format`` ``"avro"``),
        once a value of it was decoded (:meth:`record`) and when a reader other than the
        runtime's may use it (a record schema without references); else None."""
        return None if self._schemas is None else self._schemas(schema_id)

    def topic(self, i: int) -> str:
        """The topic of value ``i``'s message."""
        if self._coords is not None:
            return self._coords(self._index[i])[0]
        r = self.record(i)
        return "" if r is None else r.topic

    def key(self, i: int) -> bytes | None:
        """The key of value ``i``'s message, as its bytes."""
        if self._coords is not None:
            return self._coords(self._index[i])[1]
        r = self.record(i)
        return None if r is None else r.key

    def topics(self) -> list[str]:
        """Every value's :meth:`topic`, in order, in one pass."""
        msgs = self._messages
        if msgs is None:
            return [self.topic(i) for i in range(len(self.values))]
        return [msgs[at].topic() or "" for at in self._index]

    def keys(self) -> list[bytes | None]:
        """Every value's :meth:`key`, in order, in one pass."""
        msgs = self._messages
        if msgs is None:
            return [self.key(i) for i in range(len(self.values))]
        return [k if (k := msgs[at].key()).__class__ is bytes else None for at in self._index]

    def subset(self, positions: Sequence[int]) -> RawBatch:
        """The values at ``positions`` (of this batch), as a batch of their own."""
        return RawBatch(
            [self.values[i] for i in positions],
            self._decode,
            self._decoded,
            [self._index[i] for i in positions],
            shape=self.shape,
            coords=self._coords,
            schemas=self._schemas,
            messages=self._messages,
        )

    def __len__(self) -> int:
        return len(self.values)

    def record(self, i: int) -> Record | None:
        """Record ``i`` decoded; None when its value is not a JSON object."""
        at = self._index[i]
        got = self._decoded.get(at)
        if got is None:
            got = self._decoded[at] = self._decode(at)
        return got if isinstance(got, Record) else None

    def records(self) -> list[Record]:
        """Every record that decodes, in order."""
        out = []
        for i in range(len(self.values)):
            r = self.record(i)
            if r is not None:
                out.append(r)
        return out

    def undecodable(self) -> dict[int, str]:
        """Values found not to be JSON objects so far (position in the first batch -> reason)."""
        return {at: got for at, got in self._decoded.items() if isinstance(got, str)}

    def without(self, record_ids: Collection[str]) -> RawBatch:
        """This batch less the records with these ids (:attr:`Record.record_id`)."""
        if self._ids is None:
            self._ids = {}
            for i in range(len(self.values)):
                r = self.record(i)
                if r is not None:
                    self._ids[r.record_id] = i
        drop = {self._ids[rid] for rid in record_ids if rid in self._ids}
        return self.subset([i for i in range(len(self.values)) if i not in drop])
