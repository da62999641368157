"""Files sink: Parquet (default) or JSON Lines, published by atomic rename, one manifest per part.

Layout under the configured ``path`` (bookkeeping sits under ``_twophase/``, which Spark, DuckDB
and ``pyarrow.dataset`` skip by default, like every name that starts with ``_`` or ``.``)::

    {path}/{topic}/date=YYYY-MM-DD/part-{txn:012d}-{participant}-{seq:04d}.parquet   committed data
    {path}/_twophase/{pipeline}/open/{token}/          the part being written (+ LOCK, held by flock)
    {path}/_twophase/{pipeline}/prepared/{token}/      staged: fsynced data files + PREPARED.json
    {path}/_twophase/{pipeline}/manifests/{txn:012d}-{participant}.json   commit marker + file list
    {path}/_twophase/{pipeline}/trash/                 directories being deleted

Life of a part:

* ``begin``: create ``open/{token}/`` and hold an exclusive ``flock`` on its ``LOCK`` file for as
  long as this process owns the part. The kernel drops the lock when the process dies, which is
  how :meth:`FileSink.stale_parts` tells abandoned parts from live ones.
* ``write``: records are grouped per output file (topic and UTC date of the record timestamp; a
  timestamp no date names -- none, or after 9999-12-31 -- goes under the null date) and
  buffered as Arrow tables (Parquet) or encoded lines (JSON Lines). A buffer that reaches
  ``max_file_records`` is written to a complete, fsynced file in the open directory; when all
  buffers together exceed ``max_buffered_records`` the largest is written early.
* ``prepare``: write the remaining buffers, write ``PREPARED.json`` (positions, the file list with
  target paths, record counts, sizes, SHA-256) atomically, fsync the directory, then rename
  ``open/{token}`` to ``prepared/{token}`` -- the atomic prepare -- and fsync both parents.
* ``commit``: hard-link every staged file to its target (no-replace, so a file is never
  overwritten; rename where hard links are unsupported), fsync the target directories, write the
  manifest atomically -- the commit point of this part in this store -- and discard the staged
  directory. Every step can be repeated, by any process, after a crash at any point.
* ``abort``: the open or prepared directory disappears by one rename into ``trash/``.

Housekeeping: the manifests also hold each part's source positions and commit time, so
:meth:`FileSink.committed_positions` is the highest offset per partition over them,
:meth:`FileSink.last_committed` the manifest with the highest txn, and :meth:`FileSink.forget`
deletes old manifests but the best one of each partition and those of the highest txn, which
keeps ``manifests/`` bounded.

What readers see: no file appears in ``{path}/{topic}`` before ``commit``, and every file that
appears is complete (it was fsynced before it was linked). While a part commits, a reader that
lists the directories may see some of its files before others; the manifest is the atomic view:
read ``manifests/*.json`` and load exactly the files they list for a transactionally consistent
snapshot.

Schema (Parquet): with ``schema`` configured, each record is checked against it (the SDK's
shared conversion rules, :mod:`twophase.participants.sdk.values`) and a value that does not fit is
returned as :class:`Rejected` naming the field; all files then share one schema. Without it, each
column's type is decided when a file is written, from *all* of that file's values of the field,
so no record is refused because of the records around it or their order (``docs/types.md``):
Arrow's own inference when it is exact (ints with floats become doubles only when every int is
exactly a double; objects merge their keys), integers outside int64 as ``decimal(38, 0)``, and
anything else -- mixed types, nesting Parquet readers cannot read -- as the values' exact JSON
text, the column named in the file's ``twophase.json_columns`` metadata. Inferred schemas can
differ between files, so configure ``schema`` for datasets that readers scan as one table.
Parquet cannot store an empty group, so ``{}`` nested in a record is stored as null. Buffered
records wait as Arrow arrays, typed per write; a field whose writes disagree is re-typed from
all of its values when the file is written.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import hashlib
import itertools
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, model_validator

from twophase.participants.sdk import (
    AbortTransactionError,
    BackpressureError,
    BatchingSink,
    CommittedInfo,
    FatalSinkError,
    PartId,
    PartMarker,
    PartState,
    Positions,
    Record,
    Rejected,
    RetriableSinkError,
    SinkConfig,
    SinkContext,
    SinkError,
    TopicPartition,
    UnknownPartError,
    values,
)
from twophase.participants.sdk.staging import (
    discard_tree,
    fsync_dir,
    makedirs_durable,
    read_json,
    remove_tree,
    rename_durable,
    write_durable,
    write_json_atomic,
)

__all__ = ["FieldType", "FileSink", "FileSinkConfig"]

#: Bookkeeping directory under ``path``; the leading underscore hides it from dataset readers.
STATE_DIR = "_twophase"
PREPARED_FILE = "PREPARED.json"
LOCK_FILE = "LOCK"
DOCUMENT_VERSION = 1

#: What Hive and Spark read back as a null partition value: records whose timestamp has no
#: calendar date (none, or past 9999-12-31).
NULL_DATE = "__HIVE_DEFAULT_PARTITION__"
SOURCE_COLUMNS = ("_topic", "_partition", "_offset", "_timestamp_ms")

# Freeing disk space takes an operator or a retention job, not milliseconds: asking the runtime
# to come back in half a minute keeps a full disk from turning into a busy retry loop.
_DISK_FULL_RETRY_S = 30.0

_DAY_MS = 86_400_000
#: The last day a ``date`` can name (9999-12-31), in days since the epoch. Kafka takes any
#: int64 timestamp once a topic's ``message.timestamp.after.max.ms`` is raised.
_LAST_DAY = (date.max - date(1970, 1, 1)).days
_FATAL_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV})
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# link(2) fails with these where the file system has no hard links (or forbids them to us).
_NO_HARDLINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK})
_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_ARROW_VALUE_ERRORS: tuple[type[BaseException], ...] = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    OverflowError,
)

FieldType = Literal[
    "string", "int32", "int64", "float32", "float64", "bool", "timestamp", "date", "json"
]

_ARROW_TYPES: dict[str, Any] = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("ms", tz="UTC"),
    "date": pa.date32(),
    "json": pa.string(),
}


class FileSinkConfig(SinkConfig):
    """``sinks[]`` entry of ``type: files``."""

    type: Literal["files"]
    #: Base directory of the dataset; must be one local (POSIX) file system.
    path: Path
    #: ``parquet``, or ``jsonl`` (JSON Lines: one record per line).
    format: Literal["parquet", "jsonl"] = "parquet"
    #: Parquet codec. Default snappy for Parquet; JSON Lines supports only ``none``.
    compression: Literal["snappy", "zstd", "none"] | None = None
    #: ``topic+date``: ``{path}/{topic}/date=YYYY-MM-DD/`` (UTC date of the record timestamp;
    #: ``date=__HIVE_DEFAULT_PARTITION__`` when it has none or is after 9999-12-31).
    partition_by: Literal["topic+date", "topic", "none"] = "topic+date"
    #: A file is closed and a new one started after this many records.
    max_file_records: int = Field(default=250_000, ge=1)
    #: Records held in memory across all files of the open part; default 2 x max_file_records.
    max_buffered_records: int | None = Field(default=None, ge=1)
    #: ``{field: type}``. Records are checked against it; without it Parquet infers per file.
    schema_: dict[str, FieldType] | None = Field(default=None, alias="schema")
    #: With ``schema``: reject records that carry fields it does not name, or drop those fields.
    unknown_fields: Literal["reject", "drop"] = "reject"
    #: Add ``_topic``, ``_partition``, ``_offset``, ``_timestamp_ms`` to every row.
    source_columns: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.format == "jsonl" and self.compression not in (None, "none"):
            raise ValueError("compression: JSON Lines files support only 'none'")
        if self.schema_ is not None:
            if not self.schema_:
                raise ValueError("schema: name at least one field (or leave it out to infer)")
            if self.source_columns and (clash := set(SOURCE_COLUMNS) & set(self.schema_)):
                raise ValueError(f"schema: {sorted(clash)} collide with source_columns")
        return self

    @property
    def parquet_compression(self) -> str:
        return self.compression or "snappy"

    @property
    def buffered_limit(self) -> int:
        return self.max_buffered_records or 2 * self.max_file_records


# -- staged files and buffers ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FileEntry:
    """One data file of a part: where it is staged, where it goes, and how to recognise it."""

    name: str  # inside the open/prepared directory
    target: str  # relative to ``path``, POSIX separators
    topic: str | None
    records: int
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "topic": self.topic,
            "records": self.records,
            "bytes": self.size,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> _FileEntry:
        return cls(
            name=str(raw["name"]),
            target=str(raw["target"]),
            topic=None if raw.get("topic") is None else str(raw["topic"]),
            records=int(raw["records"]),
            size=int(raw["bytes"]),
            sha256=str(raw["sha256"]),
        )


#: Output file group: (topic or None, date or None).
_Key = tuple[str | None, str | None]


@dataclass(slots=True)
class _Buffer:
    """Records of one output file not yet written: encoded JSON lines, or for Parquet the
    records (converted rows with a configured schema), turned into one table when the file is
    written -- so an inferred column type is decided from the whole file, not its first rows."""

    chunks: list[Any] = field(default_factory=list)
    rows: int = 0


@dataclass(slots=True)
class _OpenFiles:
    """What the open part keeps in memory: its directory and lock, the buffered records and the
    files written so far (the part's life cycle itself is :class:`BatchingSink`'s)."""

    part: PartId
    directory: Path
    lock_fd: int
    buffers: dict[_Key, _Buffer] = field(default_factory=dict)
    files: list[_FileEntry] = field(default_factory=list)
    seq: int = 0
    records: int = 0
    rejected: int = 0
    buffered: int = 0
    started: float = field(default_factory=time.monotonic)


class _Mismatch(ValueError):
    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"field {field_name!r}: {reason}")
        self.field_name = field_name


def _rejected(record: Record, reason: str, field_name: str | None) -> Rejected:
    return Rejected(record, reason, {"field": field_name} if field_name else {})


# -- configured schema -----------------------------------------------------------------------


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _to_string(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError(f"expected string, got {_describe(value)}")
    return value


def _to_int(bits: int) -> Callable[[Any], Any]:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def convert(value: Any) -> Any:
        try:
            return values.to_integer(value, low, high, f"int{bits}")
        except values.BadValue as exc:
            raise ValueError(str(exc)) from None

    return convert


def _to_float(bits: int, limit: float) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        try:
            number = values.to_float(value)
        except values.BadValue as exc:
            raise ValueError(str(exc)) from None
        if math.isfinite(number) and abs(number) > limit:
            raise ValueError(f"out of the float{bits} range")
        return number

    return convert


def _to_bool(value: Any) -> Any:
    try:
        return values.to_bool(value)
    except values.BadValue as exc:
        raise ValueError(str(exc)) from None


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _to_timestamp(value: Any) -> Any:
    """Epoch milliseconds (int) or an ISO-8601 string; naive times are UTC."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("expected an ISO-8601 timestamp or epoch milliseconds") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return (moment - _EPOCH) // timedelta(milliseconds=1)
    raise ValueError(f"expected timestamp, got {_describe(value)}")


def _to_date(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return date.fromisoformat(value)
        except ValueError:
            raise ValueError("expected a YYYY-MM-DD date") from None
    raise ValueError(f"expected date, got {_describe(value)}")


def _to_json(value: Any) -> Any:
    return values.json_text(value).decode()  # BadValue is a ValueError: the record is refused


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "string": _to_string,
    "int32": _to_int(32),
    "int64": _to_int(64),
    "float32": _to_float(32, 3.4028234663852886e38),
    "float64": _to_float(64, float("inf")),
    "bool": _to_bool,
    "timestamp": _to_timestamp,
    "date": _to_date,
    "json": _to_json,
}


class _SchemaCheck:
    """Checks a record against the configured ``{field: type}`` and converts it for Arrow."""

    def __init__(self, schema: Mapping[str, str], unknown_fields: str) -> None:
        self.fields = [(name, _CONVERTERS[kind]) for name, kind in schema.items()]
        self.names = frozenset(schema)
        self.reject_unknown = unknown_fields == "reject"

    def unknown(self, value: Mapping[str, Any]) -> str | None:
        if self.reject_unknown and not value.keys() <= self.names:
            return next(k for k in value if k not in self.names)
        return None

    def convert(self, value: Mapping[str, Any]) -> list[Any]:
        """The row in schema order; raises :class:`_Mismatch` naming the first bad field."""
        if (extra := self.unknown(value)) is not None:
            raise _Mismatch(extra, "not in the configured schema")
        row: list[Any] = []
        for name, convert in self.fields:
            raw = value.get(name)
            if raw is None:
                row.append(None)
                continue
            try:
                row.append(convert(raw))
            except ValueError as exc:
                raise _Mismatch(name, str(exc)) from None
        return row


# -- encoders --------------------------------------------------------------------------------


class _Refused(ValueError):
    """One record this sink cannot store; ``field_name`` when one field is at fault."""

    def __init__(self, reason: str, field_name: str | None = None) -> None:
        super().__init__(reason)
        self.field_name = field_name


class _Encoder(abc.ABC):
    """Turns records into buffered chunks and chunks into the bytes of one file.

    :meth:`row` is the one place a record is judged: ``write`` (through :meth:`encode`) and
    ``check`` both call it, so they refuse exactly the same records for the same reasons.
    Nothing in it looks at other records: whether a record is refused never depends on the
    batch it came with or on its place in it."""

    extension: ClassVar[str]

    def __init__(self, config: FileSinkConfig) -> None:
        self.config = config
        self.check = _SchemaCheck(config.schema_, config.unknown_fields) if config.schema_ else None

    @abc.abstractmethod
    def row(self, record: Record) -> Any:
        """What a chunk holds for ``record``; raises :class:`_Mismatch` / :class:`_Refused`."""

    def encode(self, records: Sequence[Record], buf: _Buffer) -> tuple[Any, list[Rejected]]:
        """A chunk of the accepted records (None when none is), and the rejected ones."""
        rows: list[Any] = []
        rejected: list[Rejected] = []
        for record in records:
            try:
                rows.append(self.row(record))
            except (_Mismatch, _Refused) as exc:
                rejected.append(_rejected(record, str(exc), exc.field_name))
        return (self.chunk(rows) if rows else None), rejected

    def chunk(self, rows: list[Any]) -> Any:
        return rows

    @abc.abstractmethod
    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        """The complete file content for ``chunks``."""

    @staticmethod
    def rows(chunk: Any) -> int:
        return len(chunk)

    def cut(self, chunk: Any, start: int, length: int) -> Any:
        """Rows ``start .. start+length`` of ``chunk``."""
        return chunk[start : start + length]


def _source_clash(value: Mapping[str, Any]) -> None:
    if clash := next((c for c in SOURCE_COLUMNS if c in value), None):
        raise _Mismatch(clash, "collides with a source column")


class _JsonLinesEncoder(_Encoder):
    extension = "jsonl"

    def row(self, record: Record) -> Any:
        value: dict[str, Any] = record.value
        check = self.check
        if check is not None:
            check.convert(value)
            if not check.reject_unknown and not value.keys() <= check.names:
                value = {k: v for k, v in value.items() if k in check.names}
        if self.config.source_columns:
            _source_clash(value)
            value = {
                **value,
                "_topic": record.topic,
                "_partition": record.partition,
                "_offset": record.offset,
                "_timestamp_ms": record.timestamp_ms,
            }
        try:
            return orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:
            pass
        try:  # integers wider than 64 bits: the exact text (docs/types.md)
            return values.json_text(value) + b"\n"
        except values.BadValue as exc:
            raise _Refused(f"value cannot be written as JSON: {exc}") from None

    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        return memoryview(b"".join(itertools.chain.from_iterable(chunks)))


#: Deepest value a file may hold, in nesting levels: beyond it the JSON text of a value (the
#: fallback below) is no longer safe to produce. Also refused by the MongoDB sink (100 levels).
MAX_NESTING = 255
#: Parquet readers refuse a schema nested 100 levels deep (pyarrow/parquet-cpp: "Parquet schema
#: too deeply nested"; a struct is one level, a list two): such columns are stored as JSON text.
_PARQUET_MAX_LEVELS = 100
#: Digits of Parquet's widest decimal (decimal128 with precision 38).
_DECIMAL_DIGITS = 38
#: File metadata key naming the columns stored as JSON text (a JSON list of names).
JSON_COLUMNS_KEY = "twophase.json_columns"


def _deeper_than(value: Any, limit: int) -> bool:
    """True when ``value`` nests more than ``limit`` levels (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


class _ParquetEncoder(_Encoder):
    extension = "parquet"

    def __init__(self, config: FileSinkConfig) -> None:
        super().__init__(config)
        schema = config.schema_ or {}
        self.arrow_schema = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in schema.items()])

    def row(self, record: Record) -> Any:
        value = record.value
        source = self.config.source_columns
        if self.check is not None:
            row = self.check.convert(value)
            if source:
                _source_clash(value)
            return (row, record)
        if source:
            _source_clash(value)
        elif not value:
            raise _Refused("empty object: a Parquet row needs a column (or set source_columns)")
        # A value of n levels is at least 2n bytes of JSON: most records skip the walk.
        if (record.size == 0 or record.size > 2 * MAX_NESTING) and _deeper_than(value, MAX_NESTING):
            raise _Refused(f"nested deeper than {MAX_NESTING} levels")
        return record

    def chunk(self, rows: list[Any]) -> Any:
        if self.check is not None:
            return self._configured_table(rows)
        return _Columns.of(rows, self.config.source_columns)

    def cut(self, chunk: Any, start: int, length: int) -> Any:
        return chunk.slice(start, length)

    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        json_columns: list[str] = []
        if self.check is not None:
            table = chunks[0] if len(chunks) == 1 else pa.concat_tables(chunks)
        else:
            table, json_columns = _Columns.table(chunks)
        table = _without_empty_structs(table)
        metadata = {"twophase.part": part.token}
        if json_columns:
            metadata[JSON_COLUMNS_KEY] = orjson.dumps(json_columns).decode()
        table = table.replace_schema_metadata(metadata)
        out = pa.BufferOutputStream()
        pq.write_table(table, out, compression=self.config.parquet_compression)
        return memoryview(out.getvalue())

    def _configured_table(self, rows: list[tuple[list[Any], Record]]) -> Any:
        columns: list[list[Any]] = [[] for _ in self.arrow_schema]
        for row, _record in rows:
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        arrays = [
            pa.array(column, type=f.type)
            for column, f in zip(columns, self.arrow_schema, strict=True)
        ]
        names = list(self.arrow_schema.names)
        if self.config.source_columns:
            arrays.extend(_source_arrays([record for _row, record in rows]))
            names.extend(SOURCE_COLUMNS)
        return pa.Table.from_arrays(arrays, names=names)


@dataclass(slots=True)
class _Columns:
    """A chunk of inferred Parquet: one write's records of one file, per field an Arrow array
    (Arrow's exact inference over the chunk) or, where the chunk's values have no exact Arrow
    type, the values themselves. Arrays keep the buffer small (~150 bytes a record, against
    ~800 as Python objects); the file's column types are decided from all chunks when the file
    is written (:meth:`table`), so a record is never judged by the chunk it came in."""

    rows: int
    fields: dict[str, Any]
    #: The source columns (arrays), when configured.
    source: list[Any] | None

    def __len__(self) -> int:
        return self.rows

    @classmethod
    def of(cls, records: list[Record], source_columns: bool) -> _Columns:
        objs = [r.value for r in records]
        try:
            batch = pa.RecordBatch.from_struct_array(pa.array(objs))
            fields: dict[str, Any] = dict(zip(batch.schema.names, batch.columns, strict=True))
        except _ARROW_VALUE_ERRORS:
            fields = {}
            for name in dict.fromkeys(k for v in objs for k in v):
                values = [v.get(name) for v in objs]
                try:
                    fields[name] = pa.array(values)
                except _ARROW_VALUE_ERRORS:
                    fields[name] = values
        return cls(len(objs), fields, _source_arrays(records) if source_columns else None)

    def slice(self, start: int, length: int) -> _Columns:
        fields = {
            name: (f[start : start + length] if isinstance(f, list) else f.slice(start, length))
            for name, f in self.fields.items()
        }
        source = None if self.source is None else [a.slice(start, length) for a in self.source]
        return _Columns(length, fields, source)

    def values(self, name: str) -> list[Any]:
        """This chunk's values of ``name`` as Python objects (None where absent)."""
        f = self.fields.get(name)
        if f is None:
            return [None] * self.rows
        return f if isinstance(f, list) else f.to_pylist()

    @staticmethod
    def table(chunks: list[_Columns]) -> tuple[Any, list[str]]:
        """One file's table and its JSON-text columns. A field whose chunks agree on one Arrow
        type is concatenated as is; otherwise its type is decided from all of its values
        (:func:`_column`), which gives what one inference over the whole file would."""
        names = list(dict.fromkeys(n for c in chunks for n in c.fields))
        arrays: list[Any] = []
        json_columns: list[str] = []
        for name in names:
            pieces = [c.fields.get(name) for c in chunks]
            kinds = {p.type for p in pieces if p is not None and not isinstance(p, list)}
            column: Any = None
            if len(kinds) == 1 and not any(isinstance(p, list) for p in pieces):
                kind = kinds.pop()
                column = pa.chunked_array(
                    [
                        p if p is not None else pa.nulls(c.rows, kind)
                        for p, c in zip(pieces, chunks, strict=True)
                    ],
                    type=kind,
                )
            else:
                column = _column([v for c in chunks for v in c.values(name)])
            if column is None or not _parquet_ok(column.type):
                column = _json_column([v for c in chunks for v in c.values(name)])
                json_columns.append(name)
            arrays.append(column)
        if chunks[0].source is not None:
            for i in range(len(SOURCE_COLUMNS)):
                arrays.append(pa.chunked_array([c.source[i] for c in chunks if c.source]))
            names.extend(SOURCE_COLUMNS)
        return pa.Table.from_arrays(arrays, names=names), json_columns


def _source_arrays(records: Sequence[Record]) -> list[Any]:
    return [
        pa.array([r.topic for r in records], type=pa.string()),
        pa.array([r.partition for r in records], type=pa.int32()),
        pa.array([r.offset for r in records], type=pa.int64()),
        pa.array([r.timestamp_ms for r in records], type=pa.int64()),
    ]


#: Type of a column stored as JSON text.
_JSON_TEXT = pa.string()


def _column(column: list[Any]) -> Any | None:
    """The Arrow array of one field's values (None where absent or null), by the rule of
    ``docs/types.md``: Arrow's own inference over all of them when it is exact (it refuses
    rather than round: an integer past 2**53 next to a float fails); integers that do not all
    fit int64 as decimal(38, 0) when they fit 38 digits; None: anything else, stored as JSON
    text by the caller."""
    try:
        return pa.array(column)
    except _ARROW_VALUE_ERRORS:
        pass
    present = [v for v in column if v is not None]
    if all(v.__class__ is int for v in present) and all(
        len(str(abs(v))) <= _DECIMAL_DIGITS for v in present
    ):
        return pa.array(
            [None if v is None else Decimal(v) for v in column],
            type=pa.decimal128(_DECIMAL_DIGITS, 0),
        )
    return None


def _json_column(column: list[Any]) -> Any:
    """Each value as its exact JSON text (``"12"`` and ``12`` stay apart: ``"\"12\""``, ``"12"``)."""
    return pa.array(
        [None if v is None else values.json_text(v).decode() for v in column], type=_JSON_TEXT
    )


def _levels(kind: Any) -> int:
    """Parquet schema levels of an Arrow type (a struct adds one, a list two)."""
    if pa.types.is_struct(kind):
        return 1 + max((_levels(kind.field(i).type) for i in range(kind.num_fields)), default=0)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return 2 + _levels(kind.value_type)
    return 1


def _parquet_ok(kind: Any) -> bool:
    return bool(_levels(kind) < _PARQUET_MAX_LEVELS)


def _has_empty_struct(kind: Any) -> bool:
    if pa.types.is_struct(kind):
        return kind.num_fields == 0 or any(
            _has_empty_struct(kind.field(i).type) for i in range(kind.num_fields)
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _has_empty_struct(kind.value_type)
    return False


def _without_empty_struct_type(kind: Any) -> Any:
    if pa.types.is_struct(kind):
        if kind.num_fields == 0:
            return pa.null()
        return pa.struct(
            [
                pa.field(kind.field(i).name, _without_empty_struct_type(kind.field(i).type))
                for i in range(kind.num_fields)
            ]
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(_without_empty_struct_type(kind.value_type))
    return kind


def _without_empty_struct_value(value: Any, kind: Any) -> Any:
    if value is None:
        return None
    if pa.types.is_struct(kind):
        if kind.num_fields == 0:
            return None
        return {
            kind.field(i).name: _without_empty_struct_value(
                value.get(kind.field(i).name), kind.field(i).type
            )
            for i in range(kind.num_fields)
        }
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return [_without_empty_struct_value(v, kind.value_type) for v in value]
    return value


def _without_empty_structs(table: Any) -> Any:
    """Parquet has no empty group: store ``{}`` (type ``struct<>``) as null instead."""
    for i, f in enumerate(table.schema):
        if _has_empty_struct(f.type):
            kind = _without_empty_struct_type(f.type)
            values = [_without_empty_struct_value(v, f.type) for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(f.name, kind), pa.array(values, type=kind))
    return table


# -- the sink --------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _positions_json(positions: Positions) -> list[dict[str, Any]]:
    return [
        {"topic": topic, "partition": partition, "offset": offset}
        for (topic, partition), offset in sorted(positions.items())
    ]


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _ManifestInfo:
    """What housekeeping needs of one manifest: its part, its positions and when it was
    committed (immutable once written, so cached per file name and inode)."""

    inode: int
    txn: int
    participant: str
    positions: dict[TopicPartition, int]
    committed_at: datetime | None


def _manifest_time(raw: Mapping[str, Any]) -> datetime | None:
    """The ``committed_at`` of a manifest document (see :func:`_now`); None when absent."""
    text = raw.get("committed_at")
    if not isinstance(text, str):
        return None
    moment = datetime.fromisoformat(text)
    return moment if moment.utcoffset() is not None else moment.replace(tzinfo=UTC)


def _manifest_positions(raw: Any) -> dict[TopicPartition, int]:
    """The ``positions`` of a manifest document (see :func:`_positions_json`)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("positions"), list):
        raise ValueError("not a manifest document")
    out: dict[TopicPartition, int] = {}
    for item in raw["positions"]:
        tp = (str(item["topic"]), int(item["partition"]))
        out[tp] = max(out.get(tp, 0), int(item["offset"]))
    return out


class FileSink(BatchingSink):
    """Exactly-once Parquet / JSON Lines files: staged, fsynced, published by atomic rename.

    The part's directory is its marker: ``open/{token}/`` is open, ``prepared/{token}/`` is
    prepared, a manifest is committed, and nothing at all is aborted (or unknown).
    """

    config_model: ClassVar[type[SinkConfig]] = FileSinkConfig
    config: FileSinkConfig

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        if not isinstance(config, FileSinkConfig):
            raise TypeError(f"FileSink needs a FileSinkConfig, got {type(config).__name__}")
        super().__init__(config, context)
        self.base = config.path.absolute()
        self.state = self.base / STATE_DIR / context.pipeline
        self._encoder: _Encoder = (
            _ParquetEncoder(config) if config.format == "parquet" else _JsonLinesEncoder(config)
        )
        # The open part in memory: set by its open marker, taken by its prepare or discard. The
        # lock guards the field (a discard on the control thread, a begin on the data thread).
        self._open_files: _OpenFiles | None = None
        self._open_files_lock = threading.Lock()
        # Serialises publish/discard/the prepared listing in this process; other processes are
        # safe because every step is idempotent and checks the file system, not memory.
        self._decide_lock = threading.Lock()
        self._hardlinks = True
        self._dates: dict[int, str] = {}
        # Manifests read so far, by file name: listing the directory is cheap, parsing thousands
        # of JSON documents on every call is not. Guarded by its own lock.
        self._manifests_lock = threading.Lock()
        self._manifest_cache: dict[str, _ManifestInfo] = {}

    # -- directories --

    def _dir(self, kind: str) -> Path:
        return self.state / kind

    def _open_dir(self, part: PartId) -> Path:
        return self.state / "open" / part.token

    def _prepared_dir(self, part: PartId) -> Path:
        return self.state / "prepared" / part.token

    def _manifest(self, part: PartId) -> Path:
        return self.state / "manifests" / f"{part.txn:012d}-{part.participant}.json"

    # -- errors --

    @contextlib.contextmanager
    def _fs(self, action: str, part: PartId | None, failure: type[SinkError]) -> Iterator[None]:
        """Map OSError to the SDK's three branches; permissions and read-only stores are fatal."""
        try:
            yield
        except SinkError:
            raise
        except OSError as exc:
            where = f"part {part.token}: " if part else ""
            message = f"{where}{action} failed under {self.base}: {exc}"
            if exc.errno in _FATAL_ERRNOS:
                raise FatalSinkError(message, sink=self.name) from exc
            if failure is RetriableSinkError and exc.errno in _DISK_FULL_ERRNOS:
                raise BackpressureError(
                    message, retry_after_s=_DISK_FULL_RETRY_S, sink=self.name
                ) from exc
            raise failure(message, sink=self.name) from exc
        except pa.ArrowException as exc:
            where = f"part {part.token}: " if part else ""
            raise FatalSinkError(
                f"{where}{action}: Arrow refused the data: {exc}", sink=self.name
            ) from exc

    # -- life cycle --

    def setup(self) -> None:
        with self._fs("setup", None, RetriableSinkError):
            for kind in ("open", "prepared", "manifests", "trash"):
                makedirs_durable(self._dir(kind))
            for leftover in self._dir("trash").iterdir():
                remove_tree(leftover)
            for entry in self._dir("open").iterdir():
                # ``.begin-*``: a begin that died before its rename; nobody can own it.
                if entry.name.startswith(".") and (fd := self._claim(entry)) is not None:
                    remove_tree(entry)
                    if fd >= 0:
                        os.close(fd)
            if os.stat(self.base).st_dev != os.stat(self.state).st_dev:
                raise FatalSinkError(
                    f"{self.state} is on another file system than {self.base}: "
                    "publishing by rename needs one file system",
                    sink=self.name,
                )
            self._hardlinks = self._probe_hardlinks()
        self.log.info(
            "files sink %s ready: %s, format %s, staging %s%s",
            self.name,
            self.base,
            self.config.format,
            self.state,
            "" if self._hardlinks else " (no hard links: publishing by rename)",
        )

    def _probe_hardlinks(self) -> bool:
        probe = self._dir("trash") / f"probe-{uuid.uuid4().hex[:12]}"
        write_durable(probe, b"")
        try:
            os.link(probe, probe.with_name(probe.name + ".link"))
        except OSError as exc:
            if exc.errno in _NO_HARDLINK_ERRNOS:
                return False
            raise
        finally:
            probe.unlink(missing_ok=True)
            probe.with_name(probe.name + ".link").unlink(missing_ok=True)
        return True

    def close(self) -> None:
        """Discard the open part, if any (it can never be prepared now); prepared parts stay."""
        with self._open_files_lock:
            op = self._open_files
        if op is None:
            return
        try:
            self.abort(op.part)
        except SinkError as exc:
            self.log.warning(
                "part %s: could not discard the open part on close: %s", op.part.token, exc
            )

    # -- markers: the part's directory, or its manifest --

    def load_marker(self, part: PartId) -> PartMarker | None:
        with self._fs("reading the part's state", part, RetriableSinkError):
            manifest = self._manifest(part)
            try:
                return self._marker(part, "committed", read_json(manifest), manifest)
            except FileNotFoundError:
                pass
            staged = self._read_prepared(part, self._prepared_dir(part))
            if staged is not None:
                prepared = self._prepared_dir(part) / PREPARED_FILE
                return self._marker(part, "prepared", staged[0], prepared)
            if self._open_dir(part).exists():
                return PartMarker(part, "open")
        return None

    def _marker(self, part: PartId, state: PartState, document: Any, path: Path) -> PartMarker:
        """The marker a manifest or ``PREPARED.json`` stands for (both hold the positions)."""
        try:
            positions = _manifest_positions(document)
            return PartMarker(part, state, positions, int(document.get("records", 0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FatalSinkError(f"{path} is unreadable: {exc}", sink=self.name) from exc

    def save_marker(self, marker: PartMarker, *, expect: Collection[PartState | None]) -> bool:
        """``open``: create the part's directory with its LOCK held. ``prepared``: write what is
        buffered, ``PREPARED.json``, and rename the directory to ``prepared/`` (the prepare)."""
        part = marker.part
        if marker.state == "open":
            with self._fs("begin", part, RetriableSinkError):
                if self._state(part) not in expect:
                    return False
                target = self._open_dir(part)
                opened = _OpenFiles(part, target, self._create_locked(target))
            with self._open_files_lock:
                self._open_files = opened
            self.log.debug("part %s: begun in %s", part.token, target)
            return True
        if marker.state != "prepared":
            raise FatalSinkError(
                f"part {part.token}: the files sink keeps no {marker.state} marker", sink=self.name
            )
        op = self._opened(part)
        if op is None or "open" not in expect:
            return False  # not open here: the caller looks at what the part is
        with self._fs("prepare", part, AbortTransactionError):
            for key, buf in sorted(op.buffers.items(), key=lambda kv: str(kv[0])):
                if buf.rows:
                    self._flush(op, key, buf)
            document = self._document(op, marker.positions)
            write_json_atomic(op.directory / PREPARED_FILE, document)
            rename_durable(op.directory, self._prepared_dir(part))  # the prepare: atomic, complete
        with self._open_files_lock:
            if self._open_files is op:
                self._open_files = None
        os.close(op.lock_fd)
        self.log.debug(
            "part %s: %d records in %d files staged in %.3fs",
            part.token,
            op.records,
            len(op.files),
            time.monotonic() - op.started,
        )
        return True

    def _opened(self, part: PartId, *, take: bool = False) -> _OpenFiles | None:
        """The open files of ``part`` if it is open in this process (and no longer, ``take``)."""
        with self._open_files_lock:
            op = self._open_files
            if op is None or op.part != part:
                return None
            if take:
                self._open_files = None
            return op

    def _state(self, part: PartId) -> PartState | None:
        """What the directories say of ``part``, without reading any document."""
        if self._manifest(part).exists():
            return "committed"
        if self._prepared_dir(part).exists():
            return "prepared"
        if self._open_dir(part).exists():
            return "open"
        return None

    def list_parts(self, state: PartState) -> list[PartId]:
        with self._fs(f"listing {state} parts", None, RetriableSinkError):
            if state == "open":
                return [p for _, p in self._parts_in(self._dir("open"), warn=False)]
            if state == "prepared":
                return self._prepared_parts()
            if state == "committed":
                return [
                    PartId(self.context.pipeline, info.txn, info.participant)
                    for info in self._scan_manifests().values()
                ]
        return []  # an aborted part leaves nothing behind

    def _parts_in(self, directory: Path, *, warn: bool) -> Iterator[tuple[Path, PartId]]:
        for entry in directory.iterdir():
            if entry.name.startswith("."):
                continue  # a begin under way (or dead: setup removes it)
            try:
                yield entry, PartId.parse(entry.name)
            except ValueError:
                if warn:
                    self.log.warning("ignoring %s: not a part directory", entry)

    def _prepared_parts(self) -> list[PartId]:
        parts: list[PartId] = []
        with self._decide_lock:
            for entry, part in self._parts_in(self._dir("prepared"), warn=True):
                if not self.owns(part):
                    self.log.warning("ignoring %s: belongs to pipeline %s", entry, part.pipeline)
                    continue
                if self._manifest(part).exists():
                    self._discard(entry)  # committed; a crash interrupted the cleanup
                    continue
                parts.append(part)
        return parts

    def abandoned(self, part: PartId, before_txn: int) -> bool:
        """Whether the writer of the open ``part`` is gone: its ``flock`` on the part's LOCK is.

        ``before_txn`` is not needed: the lock tells a live writer from a dead one, whatever
        its transaction. Liveness comes from the kernel: the writer holds the lock until it
        prepares, aborts or dies, so no pid, host name or clock is trusted. (On NFS, ``flock``
        needs NFSv4 locks.)
        """
        fd = self._claim(self._open_dir(part))
        if fd is None:
            return False
        if fd >= 0:
            os.close(fd)
        return True

    # -- the write path --

    def _create_locked(self, target: Path) -> int:
        """Create ``target`` with its LOCK already held, so it never exists unlocked."""
        building = target.with_name(f".begin-{target.name}-{uuid.uuid4().hex[:12]}")
        building.mkdir()
        fd = os.open(building / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
            os.write(fd, orjson.dumps(owner))
            os.rename(building, target)
        except BaseException:
            os.close(fd)
            remove_tree(building)
            raise
        return fd

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        """What :meth:`write` would refuse: the same per-record code (the output group, then
        :meth:`_Encoder.row`), without buffering anything."""
        rejected: list[Rejected] = []
        row = self._encoder.row
        for record in records:
            key = self._key(record)
            if isinstance(key, str):
                rejected.append(_rejected(record, key, None))
                continue
            try:
                row(record)
            except (_Mismatch, _Refused) as exc:
                rejected.append(_rejected(record, str(exc), exc.field_name))
        return rejected

    def stage(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        """Buffer ``records`` per output file; a full buffer becomes a file in the open dir."""
        op = self._opened(part)
        if op is None:
            raise AbortTransactionError(f"part {part.token} is not open here", sink=self.name)
        with self._fs("write", part, AbortTransactionError):
            return self._write(op, records)

    def _write(self, op: _OpenFiles, records: Sequence[Record]) -> list[Rejected]:
        rejected: list[Rejected] = []
        groups: dict[_Key, list[Record]] = {}
        for record in records:
            key = self._key(record)
            if isinstance(key, str):
                rejected.append(_rejected(record, key, None))
            else:
                groups.setdefault(key, []).append(record)
        for key, group in groups.items():
            buf = op.buffers.setdefault(key, _Buffer())
            chunk, refused = self._encoder.encode(group, buf)
            rejected.extend(refused)
            if chunk is not None:
                self._append(op, key, buf, chunk)
        limit = self.config.buffered_limit
        while op.buffered > limit:
            key, buf = max(op.buffers.items(), key=lambda kv: kv[1].rows)
            self._flush(op, key, buf)
        op.rejected += len(rejected)
        return rejected

    def _key(self, record: Record) -> _Key | str:
        """The output group of ``record``, or why it has none."""
        mode = self.config.partition_by
        if mode == "none":
            return (None, None)
        topic = record.topic
        if topic in (".", "..", STATE_DIR) or not topic or not _TOPIC_CHARS.issuperset(topic):
            return f"topic {topic!r} cannot name a directory of this sink"
        if mode == "topic":
            return (topic, None)
        ts = record.timestamp_ms
        day = ts // _DAY_MS
        if ts < 0 or day > _LAST_DAY:
            # No date names it: the null partition; ``_timestamp_ms`` keeps the exact value.
            return (topic, NULL_DATE)
        text = self._dates.get(day)
        if text is None:
            if len(self._dates) > 4096:
                self._dates.clear()
            text = self._dates[day] = (date(1970, 1, 1) + timedelta(days=day)).isoformat()
        return (topic, text)

    def _append(self, op: _OpenFiles, key: _Key, buf: _Buffer, chunk: Any) -> None:
        total, start, limit = self._encoder.rows(chunk), 0, self.config.max_file_records
        while start < total:
            take = min(limit - buf.rows, total - start)
            piece = chunk if take == total else self._encoder.cut(chunk, start, take)
            buf.chunks.append(piece)
            buf.rows += take
            op.buffered += take
            op.records += take
            start += take
            if buf.rows >= limit:
                self._flush(op, key, buf)

    def _flush(self, op: _OpenFiles, key: _Key, buf: _Buffer) -> None:
        """Write the buffered rows of ``key`` as one complete, fsynced file in the open dir."""
        data = self._encoder.serialize(buf.chunks, op.part)
        seq, ext = op.seq, self._encoder.extension
        name = f"{seq:04d}.{ext}"
        write_durable(op.directory / name, data)
        topic, day = key
        filename = f"part-{op.part.txn:012d}-{op.part.participant}-{seq:04d}.{ext}"
        target = "/".join(
            p for p in (topic, None if day is None else f"date={day}", filename) if p is not None
        )
        op.files.append(
            _FileEntry(name, target, topic, buf.rows, data.nbytes, hashlib.sha256(data).hexdigest())
        )
        op.seq += 1
        op.buffered -= buf.rows
        buf.chunks, buf.rows = [], 0

    def _document(self, op: _OpenFiles, positions: Positions) -> dict[str, Any]:
        return {
            "version": DOCUMENT_VERSION,
            "token": op.part.token,
            "pipeline": op.part.pipeline,
            "txn": op.part.txn,
            "participant": op.part.participant,
            "sink": self.name,
            "format": self.config.format,
            "positions": _positions_json(positions),
            "records": op.records,
            "rejected": op.rejected,
            "files": [f.to_json() for f in op.files],
            "prepared_at": _now(),
            "prepared_by": {"host": socket.gethostname(), "pid": os.getpid()},
        }

    # -- the commit and recovery path --

    def publish(self, part: PartId) -> None:
        """Link every staged file to its target, then write the manifest: the commit point."""
        with self._decide_lock, self._fs("commit", part, RetriableSinkError):
            manifest = self._manifest(part)
            prepared = self._prepared_dir(part)
            if manifest.exists():
                if self._discard(prepared):
                    self.log.info(
                        "part %s: was committed; removed its staged leftovers", part.token
                    )
                return
            staged = self._read_prepared(part, prepared)
            if staged is None:
                if manifest.exists():  # a concurrent committer finished between our two looks
                    return
                raise UnknownPartError(
                    f"commit of part {part.token}: neither prepared nor committed in {self.state}",
                    sink=self.name,
                )
            document, files = staged
            directories: dict[Path, None] = {}
            for entry in files:
                target = self.base / entry.target
                if target.parent not in directories:
                    makedirs_durable(target.parent)
                    directories[target.parent] = None
                if not self._publish(part, prepared / entry.name, target, entry):
                    return  # another process completed the commit meanwhile
            for directory in directories:
                fsync_dir(directory)
            if prepared.exists():
                fsync_dir(prepared)  # in rename mode, the sources left this directory
            document.pop("prepared_by", None)
            document["files"] = [
                {k: v for k, v in f.to_json().items() if k != "name"} for f in files
            ]
            document["committed_at"] = _now()
            write_json_atomic(manifest, document)  # the commit point of this part here
            self._discard(prepared)
        self.log.debug(
            "part %s: %d records in %d files published", part.token, document["records"], len(files)
        )

    def _read_prepared(
        self, part: PartId, prepared: Path
    ) -> tuple[dict[str, Any], list[_FileEntry]] | None:
        """PREPARED.json of ``part`` and its files; None when the part is not prepared."""
        try:
            document = read_json(prepared / PREPARED_FILE)
            if not isinstance(document, dict) or not isinstance(document.get("files"), list):
                raise ValueError("not a PREPARED document")
            return document, [_FileEntry.from_json(raw) for raw in document["files"]]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise FatalSinkError(
                f"part {part.token}: {prepared / PREPARED_FILE} is unreadable: {exc}",
                sink=self.name,
            ) from exc

    def _publish(self, part: PartId, source: Path, target: Path, entry: _FileEntry) -> bool:
        """Put ``source`` at ``target`` without ever replacing another file there.

        Repeatable after a crash at any point: a target that already holds this file (same inode,
        or the source is gone and size and checksum match) counts as done. False when the source
        and target are both gone but the manifest exists: another process finished the commit.
        """
        if self._hardlinks:
            try:
                os.link(source, target)
                return True
            except FileExistsError:
                pass
            except FileNotFoundError:
                if source.exists():
                    raise  # the target directory vanished; the runtime retries
                return self._already_published(part, target, entry)
            except OSError as exc:
                if exc.errno not in _NO_HARDLINK_ERRNOS:
                    raise
                self._hardlinks = False
                self.log.warning("part %s: no hard links here, publishing by rename", part.token)
                return self._publish(part, source, target, entry)
            try:
                if os.path.samefile(source, target):
                    return True  # linked by an interrupted commit
            except FileNotFoundError:
                return self._already_published(part, target, entry)
            raise self._collision(part, target)
        if target.exists():
            if source.exists():
                raise self._collision(part, target)
            return self._already_published(part, target, entry)
        try:
            os.rename(source, target)
        except FileNotFoundError:
            return self._already_published(part, target, entry)
        return True

    def _already_published(self, part: PartId, target: Path, entry: _FileEntry) -> bool:
        try:
            size = target.stat().st_size
        except FileNotFoundError:
            if self._manifest(part).exists():
                return False
            raise FatalSinkError(
                f"part {part.token}: {entry.name} is neither staged nor at {target}",
                sink=self.name,
            ) from None
        if size != entry.size or _sha256_of(target) != entry.sha256:
            raise self._collision(part, target)
        return True

    def _collision(self, part: PartId, target: Path) -> FatalSinkError:
        return FatalSinkError(
            f"part {part.token}: {target} already exists and is another file; refusing to "
            "overwrite it (do two pipelines write the same path with the same participant names?)",
            sink=self.name,
        )

    def discard(self, part: PartId) -> None:
        """The open or prepared directory disappears by one rename into ``trash/``."""
        op = self._opened(part, take=True)
        if op is not None:
            os.close(op.lock_fd)  # the directory itself goes below, like any other
        prepared, opened = self._prepared_dir(part), self._open_dir(part)
        if not (prepared.exists() or opened.exists()):
            return  # nothing to discard (every begin asks): no need to wait for a commit
        with self._decide_lock, self._fs("abort", part, RetriableSinkError):
            if self._manifest(part).exists():
                raise FatalSinkError(
                    f"abort of part {part.token}, which is already committed", sink=self.name
                )
            if prepared.exists():
                self._refuse_if_publishing(part, prepared)
                self._discard(prepared)
            if opened.exists():
                self._discard_abandoned(part, opened)

    def _refuse_if_publishing(self, part: PartId, prepared: Path) -> None:
        """Abort after commit started would leave a partial part visible: refuse loudly."""
        staged = self._read_prepared(part, prepared)
        for entry in staged[1] if staged else []:
            source, target = prepared / entry.name, self.base / entry.target
            if not target.exists():
                continue
            if not source.exists() or os.path.samefile(source, target):
                raise FatalSinkError(
                    f"abort of part {part.token}, whose commit has already published {target}",
                    sink=self.name,
                )

    def _discard_abandoned(self, part: PartId, opened: Path) -> None:
        fd = self._claim(opened)
        if fd is None:
            raise RetriableSinkError(
                f"part {part.token} is open in another live process ({opened / LOCK_FILE})",
                sink=self.name,
            )
        try:
            self._discard(opened)
        finally:
            if fd >= 0:
                os.close(fd)

    def _claim(self, opened: Path) -> int | None:
        """Lock an open part's LOCK if its owner is gone: the fd (-1 without a LOCK), else None.

        After taking the lock, checks that the LOCK still lives in ``opened``: the owner releases
        the lock right after it renamed the directory to ``prepared/``, and that must not count
        as abandoned.
        """
        lock = opened / LOCK_FILE
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            return -1 if opened.exists() else None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, now = os.fstat(fd), os.stat(lock)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
        return None

    def _discard(self, directory: Path) -> bool:
        return discard_tree(directory, self._dir("trash"))

    # -- housekeeping --

    def committed_positions(self) -> dict[TopicPartition, int]:
        """Next offset per source partition: the highest in the manifests of this pipeline.

        A manifest is written at the commit point of its part, so prepared and aborted parts
        never count, and the ``max`` per partition keeps decisions applied out of order from
        moving a position back. The manifests of this dataset and pipeline are the sink's identity
        (as for ``commit`` and ``in_doubt``), whatever the sink's name.

        Cost: one listing of ``manifests/`` per call, plus parsing the manifests this instance has
        not seen yet (they never change, so they are cached by name and inode): the first call of
        a process reads all of them, later ones only the new ones. :meth:`forget` keeps their
        number bounded.
        """
        positions: dict[TopicPartition, int] = {}
        with self._fs("committed_positions", None, RetriableSinkError):
            for info in self._scan_manifests().values():
                for tp, offset in info.positions.items():
                    if offset > positions.get(tp, -1):
                        positions[tp] = offset
        return positions

    def last_committed(self) -> CommittedInfo | None:
        """The manifest of this pipeline with the highest txn (of that txn's parts, the one
        committed last), with the ``committed_at`` it records (the committer's clock).

        Same cost as :meth:`committed_positions`: one listing, new manifests parsed once.
        """
        with self._fs("last_committed", None, RetriableSinkError):
            index = self._scan_manifests()
        if not index:
            return None
        epoch = datetime.min.replace(tzinfo=UTC)
        newest = max(index.values(), key=lambda i: (i.txn, i.committed_at or epoch, i.participant))
        part = PartId(self.context.pipeline, newest.txn, newest.participant)
        return CommittedInfo(part, newest.committed_at)

    def forget(self, before_txn: int) -> int:
        """Delete the manifests of parts with ``txn < before_txn``; returns how many went.

        Only committed parts have a manifest (an aborted part leaves nothing, a prepared one has
        only its staged directory), so prepared parts and the data files are never touched. What
        :meth:`committed_positions` needs is kept: per source partition, the manifest holding its
        highest offset (ties: the newest part), whatever its txn; and what
        :meth:`last_committed` needs: the manifests of the highest txn. Concurrent calls from
        several processes are safe: a manifest is deleted only by a call that saw a better one
        for each of its partitions and a higher txn, so the best one of each partition and the
        newest stay. Staged leftovers of a
        forgotten part (a commit interrupted before its clean-up) go first, so the part can never
        look prepared again.

        After this the sink no longer knows a forgotten part: ``commit`` of it raises
        :class:`UnknownPartError`, ``abort`` of it is a no-op, and ``begin`` of its id is
        accepted. Callers pass a ``before_txn`` whose decisions nobody repeats any more (the
        decision log is past it), which is what the SDK asks of them.
        """
        forgotten = 0
        manifests = self._dir("manifests")
        with self._decide_lock, self._fs("forget", None, RetriableSinkError):
            index = self._scan_manifests()
            best: dict[TopicPartition, tuple[int, int, str]] = {}
            keep: dict[TopicPartition, str] = {}
            for name, info in index.items():
                for tp, offset in info.positions.items():
                    rank = (offset, info.txn, info.participant)
                    if tp not in best or rank > best[tp]:
                        best[tp], keep[tp] = rank, name
            needed = set(keep.values())
            newest = max((info.txn for info in index.values()), default=-1)
            for name, info in sorted(index.items()):
                if info.txn >= min(before_txn, newest) or name in needed:
                    continue
                try:
                    forgotten_part = PartId(self.context.pipeline, info.txn, info.participant)
                except ValueError:
                    pass  # not a participant name: no part of ours was staged under it
                else:
                    self._discard(self._prepared_dir(forgotten_part))
                try:
                    (manifests / name).unlink()
                except FileNotFoundError:
                    continue  # another process forgot it first
                forgotten += 1
            if forgotten:
                fsync_dir(manifests)
        if forgotten:
            self.log.info("forgot %d manifests of parts before txn %d", forgotten, before_txn)
        return forgotten

    def _scan_manifests(self) -> dict[str, _ManifestInfo]:
        """Every manifest of this pipeline by file name, parsing only those not cached yet."""
        directory = self._dir("manifests")
        with self._manifests_lock:
            cache = self._manifest_cache
            found: dict[str, _ManifestInfo] = {}
            with os.scandir(directory) as listing:
                for entry in listing:
                    name = entry.name
                    inode = entry.inode()
                    info = cache.get(name)
                    if info is None or info.inode != inode:
                        if name.startswith(".") or not name.endswith(".json"):
                            continue  # write_json_atomic's temporary files
                        txn_text, dash, participant = name[: -len(".json")].partition("-")
                        if not (dash and participant and txn_text.isdigit()):
                            continue
                        path = directory / name
                        try:
                            document = orjson.loads(path.read_bytes())
                        except FileNotFoundError:
                            continue  # forgotten by another process meanwhile
                        try:
                            positions = _manifest_positions(document)
                            committed_at = _manifest_time(document)
                        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
                            raise FatalSinkError(
                                f"manifest {path} is unreadable: {exc}", sink=self.name
                            ) from exc
                        info = _ManifestInfo(
                            inode, int(txn_text), participant, positions, committed_at
                        )
                    found[name] = info
            self._manifest_cache = found
        return found
