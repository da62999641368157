"""Parquet typed by a record's schema (``docs/types.md``, "From a record's schema").

A record that carries a :class:`~twophase.participants.sdk.RecordSchema` gets its Parquet types
from it, never inferred: :func:`arrow_type` maps each kind, and :func:`converter` reads each
value exactly by the SDK's shared rules (:mod:`twophase.participants.sdk.values`) -- a value
that does not fit its type is refused, naming the field (dotted when nested).

What a typed file holds is a record's *stored* schema (:class:`Typing`): the fields its schema
names, then the top-level fields of the value it does not name (the record key's fields, Debezium's
``add_fields``, ``kafka_fields``: typed by their JSON value, always nullable), then ``op_column``
and the source columns when configured. That is what the dataset's schema is made of and what
:func:`~twophase.participants.sdk.compare` judges (:mod:`._datasets`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from twophase.participants.sdk import Field, FieldType, PartId, Record, RecordSchema, values
from twophase.participants.sinks.files._arrow import parquet_levels, source_arrays
from twophase.participants.sinks.files._encoders import Encoder, Refused
from twophase.participants.sinks.files._schema import Mismatch
from twophase.participants.sinks.files.config import SOURCE_COLUMNS, FileSinkConfig

__all__ = [
    "SCHEMA_KEY",
    "TypedEncoder",
    "TypedRows",
    "Typing",
    "arrow_type",
    "converter",
    "decimal_type",
    "schema_from_json",
    "schema_to_json",
]

#: Digits of Parquet's widest decimal that every reader takes (decimal128; Spark and DuckDB stop
#: at 38 too -- DuckDB reads a wider one as a double, which would change values).
DECIMAL128_DIGITS = 38
#: Key of a typed file's (and ``_common_metadata``'s) key-value metadata: the record schema as
#: twophase knows it (kinds Arrow does not tell apart: uuid, enum, timestamp units).
SCHEMA_KEY = "twophase.schema"
#: Parquet readers refuse a schema nested 100 levels deep (see :mod:`._arrow`).
_PARQUET_MAX_LEVELS = 100
#: Stored schemas kept per sink (a topic has a handful of versions; extras multiply them a little).
_KEPT = 4096

_JSON = FieldType("json", nullable=True)
_SOURCE_TYPES = {
    "_topic": FieldType("string"),
    "_partition": FieldType("int32"),
    "_offset": FieldType("int64"),
    "_timestamp_ms": FieldType("int64"),
}


# -- the Parquet type of each kind ----------------------------------------------------------


def decimal_type(t: FieldType) -> tuple[int, int] | None:
    """``(precision, scale)`` of the Parquet decimal a decimal field is stored as; None: as its
    exact decimal text (a string column).

    * ``decimal(p, s)`` -> ``decimal128(p, s)``; a negative scale (zeros before the point) as
      ``decimal128(p - s, 0)``, a scale over the precision as ``decimal128(s, s)`` (Parquet
      wants 0 <= scale <= precision): the same numbers, exactly.
    * unconstrained precision with a known scale (Kafka Connect's ``Decimal`` without
      ``connect.decimal.precision``) -> ``decimal128(38, s)``: a value past 38 digits is refused.
    * unconstrained scale (Debezium's ``VariableScaleDecimal``, PostgreSQL's bare ``numeric``):
      each value has a scale of its own, which no one Parquet decimal holds -> the exact text.
    * more than 38 digits -> the exact text (decimal256 exists, but DuckDB reads it as a double).
    """
    if t.scale is None:
        return None
    precision = DECIMAL128_DIGITS if t.precision is None else t.precision
    scale = max(t.scale, 0)
    digits = max(max(precision - t.scale, 0) + scale, 1)
    if digits > DECIMAL128_DIGITS:
        return None
    return digits, scale


def arrow_type(t: FieldType) -> pa.DataType:
    """The Arrow (and so Parquet) type a field of type ``t`` is stored as."""
    kind = t.kind
    simple = _SIMPLE.get(kind)
    if simple is not None:
        return simple
    if kind == "decimal":
        fixed = decimal_type(t)
        return pa.string() if fixed is None else pa.decimal128(*fixed)
    if kind == "array":
        return pa.list_(arrow_type(t.items or _JSON))
    if kind == "map":
        return pa.map_(pa.string(), arrow_type(t.values or _JSON))
    if kind == "record":
        if not t.fields:  # Parquet has no empty group: its exact JSON text
            return pa.string()
        return pa.struct([pa.field(f.name, arrow_type(f.type)) for f in t.fields])
    raise ValueError(f"no Parquet type for kind {kind!r}")


_SIMPLE: dict[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "string": pa.string(),
    "uuid": pa.string(),
    "enum": pa.string(),
    "json": pa.string(),
    "bytes": pa.binary(),
    "date": pa.date32(),
    "time": pa.time64("us"),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_local": pa.timestamp("us"),
}


# -- each value, exactly ----------------------------------------------------------------------


Convert = Callable[[Any], Any]


def _string(value: Any) -> Any:
    if value.__class__ is not str:
        raise values.wrong(value, "a string")
    return value


def _uuid_text(value: Any) -> Any:
    values.to_uuid(value)  # a UUID; stored as the text it came as
    return value


def _json_text(value: Any) -> Any:
    return values.json_text(value).decode()


def _float32(value: Any) -> Any:
    """A float32 holds the value when the value is what a float32 prints: ``0.1`` (stored as
    the float32 nearest 0.1, which prints ``0.1``) is kept; ``0.123456789`` needs a double."""
    number = values.to_float(value)
    if not math.isfinite(number):
        return number
    try:
        single: float = struct.unpack("f", struct.pack("f", number))[0]
    except OverflowError:
        raise values.BadValue(f"{value!r} is out of the float32 range") from None
    if single == number:
        return number
    for digits in range(1, 10):  # the shortest spelling that reads back as the same float32
        text = f"{single:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == single:
            if float(text) == number:
                return number
            break
    raise values.BadValue(f"{value!r} is not a float32 value (it needs a double)")


def _integer(bits: int) -> Convert:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    name = f"int{bits}"

    def convert(value: Any) -> Any:
        return values.to_integer(value, low, high, name)

    return convert


def _local_instant(value: Any) -> Any:
    return values.to_instant(value, local=True)


def converter(t: FieldType) -> Convert:
    """The function that reads a (non-null) value of type ``t`` into what its Arrow column
    takes, exactly; raises a ValueError with the reason (and, nested, where)."""
    kind = t.kind
    if kind == "decimal":
        # Exact by the schema's own (precision, scale) first: a value that contradicts it is
        # refused even where the column could hold it.
        fixed = decimal_type(t)
        if fixed is None:

            def decimal_text(value: Any) -> Any:
                number = values.fit_decimal(values.to_decimal(value), t.precision, t.scale)
                return value if value.__class__ is str else str(number)

            return decimal_text
        precision, scale = fixed
        if (precision, scale) == (t.precision, t.scale):  # the common case: one fit

            def same_decimal(value: Any) -> Any:
                return values.fit_decimal(values.to_decimal(value), precision, scale)

            return same_decimal

        def decimal(value: Any) -> Any:
            number = values.fit_decimal(values.to_decimal(value), t.precision, t.scale)
            return values.fit_decimal(number, precision, scale)

        return decimal
    if kind == "array":
        return values.array_of(converter(t.items or _JSON))
    if kind == "map":
        inner = converter(t.values or _JSON)

        def mapping(value: Any) -> Any:
            if value.__class__ is not dict:
                raise values.wrong(value, "an object (a map)")
            out = []
            for k, x in value.items():
                try:
                    out.append((k, None if x is None else inner(x)))
                except ValueError as exc:
                    raise values.nested(f".{k}", exc) from None
            return out

        return mapping
    if kind == "record":
        if not t.fields:
            return _json_text
        fields = [(f.name, converter(f.type)) for f in t.fields]
        names = frozenset(name for name, _ in fields)

        def record(value: Any) -> Any:
            if value.__class__ is not dict:
                raise values.wrong(value, "an object (a record)")
            if not value.keys() <= names:
                extra = next(k for k in value if k not in names)
                raise values.Nested(f".{extra}", "not a field of the record's schema")
            out = {}
            for name, convert in fields:
                x = value.get(name)
                try:
                    out[name] = None if x is None else convert(x)
                except ValueError as exc:
                    raise values.nested(f".{name}", exc) from None
            return out

        return record
    simple = _CONVERTERS.get(kind)
    if simple is None:
        raise ValueError(f"no conversion for kind {kind!r}")
    return simple


_CONVERTERS: dict[str, Convert] = {
    "boolean": values.to_bool,
    "int32": _integer(32),
    "int64": _integer(64),
    "float32": _float32,
    "float64": values.to_float,
    "string": _string,
    "enum": _string,
    "uuid": _uuid_text,
    "json": _json_text,
    "bytes": values.from_base64,
    "date": values.to_date,
    "time": values.to_time,
    "timestamp": values.to_instant,
    "timestamp_local": _local_instant,
}


# -- a stored schema, compiled ------------------------------------------------------------------


class TypedRows:
    """One stored schema compiled: its Arrow schema, and each record's row converted to it.

    A record of a narrower schema (an older version: int32 where this says int64, a field
    missing) converts to it as it is -- every value fits a widened type -- so one file holds
    the records of every version its part met.
    """

    def __init__(self, schema: RecordSchema, source_columns: bool) -> None:
        self.schema = schema
        fields = [pa.field(f.name, arrow_type(f.type)) for f in schema]
        if any(parquet_levels(f.type) >= _PARQUET_MAX_LEVELS for f in fields):
            raise Refused("its schema nests deeper than Parquet readers read (100 levels)")
        self.json = orjson.dumps(schema_to_json(schema)).decode()
        self.arrow = pa.schema(fields)
        source = frozenset(SOURCE_COLUMNS) if source_columns else frozenset()
        self._source = [
            (i, SOURCE_COLUMNS.index(f.name)) for i, f in enumerate(schema) if f.name in source
        ]
        self._fields = [(f.name, converter(f.type)) for f in schema if f.name not in source]
        self._names = frozenset(name for name, _ in self._fields)

    def row(self, record: Record) -> tuple[list[Any], Record]:
        """The record's values in this schema's order; :class:`Mismatch` names the first one
        that does not fit."""
        value = record.value
        if not value.keys() <= self._names:
            extra = next(k for k in value if k not in self._names)
            raise Mismatch(extra, "not in the dataset's schema")
        out: list[Any] = []
        for name, convert in self._fields:
            raw = value.get(name)
            if raw is None:
                out.append(None)
                continue
            try:
                out.append(convert(raw))
            except values.Nested as exc:
                raise Mismatch(name + exc.where, exc.reason) from None
            except ValueError as exc:
                raise Mismatch(name, str(exc)) from None
        return out, record

    def table(self, rows: Sequence[tuple[list[Any], Record]]) -> pa.Table:
        """One chunk of converted rows as an Arrow table of this schema."""
        columns = list(zip(*(row for row, _ in rows), strict=True)) if self._fields else []
        source = source_arrays([r for _, r in rows]) if self._source else []
        arrays: list[Any] = [None] * len(self.arrow)
        for i, j in self._source:
            arrays[i] = source[j]
        k = 0
        for i, f in enumerate(self.arrow):
            if arrays[i] is None:
                arrays[i] = pa.array(columns[k], type=f.type)
                k += 1
        return pa.Table.from_arrays(arrays, schema=self.arrow)


class TypedEncoder(Encoder):
    """The encoder of one dataset's typed files in one part: the part's stored schema for it
    (:mod:`._datasets`). Every file it writes carries that schema, in Arrow and as
    ``twophase.schema`` in the file's key-value metadata."""

    extension = "parquet"

    def __init__(self, config: FileSinkConfig, rows: TypedRows) -> None:
        super().__init__(config)
        self.typed = rows

    def row(self, record: Record) -> Any:
        return self.typed.row(record)

    def chunk(self, rows: list[Any]) -> Any:
        return self.typed.table(rows)

    def cut(self, chunk: Any, start: int, length: int) -> Any:
        return chunk.slice(start, length)

    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        table = chunks[0] if len(chunks) == 1 else pa.concat_tables(chunks)
        table = table.replace_schema_metadata(
            {"twophase.part": part.token, SCHEMA_KEY: self.typed.json}
        )
        out = pa.BufferOutputStream()
        pq.write_table(table, out, compression=self.config.parquet_compression)
        return memoryview(out.getvalue())


def _json_kind(value: Any) -> str:
    """The kind a value's field the record's schema does not name is stored as."""
    kind = value.__class__
    if kind is str:
        return "string"
    if kind is bool:
        return "boolean"
    if kind is int:
        return "int64" if values.INT64_MIN <= value <= values.INT64_MAX else "json"
    if kind is float:
        return "float64"
    return "json"


class Typing:
    """Which records are stored typed (those with a schema, in Parquet without a configured
    ``schema``), and the stored schema of each (cached: a topic has a handful of versions)."""

    def __init__(self, config: FileSinkConfig) -> None:
        self.op_column = config.op_column
        self.source_columns = config.source_columns
        self._config = config
        self._stored: dict[Hashable, RecordSchema | Mismatch] = {}
        #: The names a schema gives (and op_column): a value's other fields are its extras.
        self._names: dict[Hashable, frozenset[str]] = {}
        self._compiled: dict[RecordSchema, TypedRows | Refused] = {}

    def stored(self, record: Record) -> tuple[Hashable, RecordSchema]:
        """A key naming the record's stored schema (equal keys, equal schemas), and the schema:
        the record's fields, then the value's top-level fields its schema does not name (typed by
        their JSON value, nullable; a null one is left out), ``op_column`` and the source
        columns. :class:`Mismatch` when the schema names a field the sink adds."""
        schema = record.schema
        assert schema is not None
        ident: Hashable = schema.id or schema
        names = self._names.get(ident)
        if names is None:
            if len(self._names) >= _KEPT:
                self._names.clear()
            names = self._names[ident] = frozenset(schema.names) | {self.op_column}
        extras = tuple(
            (k, _json_kind(v)) for k, v in record.value.items() if k not in names and v is not None
        )
        key = (ident, extras)
        got = self._stored.get(key)
        if got is None:
            got = self._build(schema, extras)
            if len(self._stored) >= _KEPT:
                self._stored.clear()
            self._stored[key] = got
        if isinstance(got, Mismatch):
            raise got
        return key, got

    def _build(
        self, schema: RecordSchema, extras: tuple[tuple[str, str], ...]
    ) -> RecordSchema | Mismatch:
        added = [Field(name, FieldType(kind, nullable=True)) for name, kind in extras]
        if self.op_column:
            if schema.get(self.op_column) is not None:
                return Mismatch(self.op_column, "the record's schema names op_column")
            added.append(Field(self.op_column, FieldType("string", nullable=True)))
        if self.source_columns:
            for name in SOURCE_COLUMNS:
                if schema.get(name) is not None or any(n == name for n, _ in extras):
                    return Mismatch(name, "collides with a source column")
                added.append(Field(name, _SOURCE_TYPES[name]))
        suffix = ",".join(f"{n}:{k}" for n, k in extras)
        return RecordSchema(
            schema.fields + tuple(added),
            id=f"{schema.id}+{suffix}" if schema.id else "",
            name=schema.name,
            key=schema.key,
        )

    def compiled(self, schema: RecordSchema) -> TypedRows:
        """``schema`` compiled (cached); :class:`Refused` when Parquet cannot hold it."""
        got = self._compiled.get(schema)
        if got is None:
            try:
                got = TypedRows(schema, self.source_columns)
            except Refused as exc:
                got = exc
            if len(self._compiled) >= _KEPT:
                self._compiled.clear()
            self._compiled[schema] = got
        if isinstance(got, Refused):
            raise got
        return got

    def encoder(self, schema: RecordSchema) -> TypedEncoder:
        return TypedEncoder(self._config, self.compiled(schema))

    def check(self, record: Record) -> Any:
        """The record judged by its own stored schema (``check``: no part, no dataset): what
        fits it fits every schema the dataset may widen it to."""
        _key, schema = self.stored(record)
        return self.compiled(schema).row(record)


# -- a schema as JSON (in _common_metadata, the manifests, the part's reservations) --------------


def _type_to_json(t: FieldType) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": t.kind}
    if t.nullable:
        out["nullable"] = True
    for name in ("precision", "scale", "unit"):
        if (v := getattr(t, name)) is not None:
            out[name] = v
    if t.items is not None:
        out["items"] = _type_to_json(t.items)
    if t.values is not None:
        out["values"] = _type_to_json(t.values)
    if t.fields:
        out["fields"] = [_field_to_json(f) for f in t.fields]
    if t.symbols:
        out["symbols"] = list(t.symbols)
    return out


def _field_to_json(f: Field) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name, "type": _type_to_json(f.type)}
    if f.has_default:
        out["has_default"] = True
    return out


def schema_to_json(schema: RecordSchema) -> dict[str, Any]:
    """``schema`` as a JSON object (its ``id`` left out: a stored schema is known by content)."""
    out: dict[str, Any] = {"fields": [_field_to_json(f) for f in schema]}
    if schema.name:
        out["name"] = schema.name
    if schema.key:
        out["key"] = list(schema.key)
    return out


def _type_from_json(raw: Any) -> FieldType:
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        raise ValueError(f"not a field type: {raw!r}")
    return FieldType(
        raw["kind"],
        bool(raw.get("nullable", False)),
        precision=raw.get("precision"),
        scale=raw.get("scale"),
        unit=raw.get("unit"),
        items=_type_from_json(raw["items"]) if "items" in raw else None,
        values=_type_from_json(raw["values"]) if "values" in raw else None,
        fields=tuple(_field_from_json(f) for f in raw.get("fields", ())),
        symbols=tuple(str(s) for s in raw.get("symbols", ())),
    )


def _field_from_json(raw: Any) -> Field:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ValueError(f"not a field: {raw!r}")
    return Field(raw["name"], _type_from_json(raw.get("type")), bool(raw.get("has_default")))


def schema_from_json(raw: Any) -> RecordSchema:
    """The schema :func:`schema_to_json` wrote; ValueError when ``raw`` is not one."""
    if not isinstance(raw, dict) or not isinstance(raw.get("fields"), list):
        raise ValueError("not a record schema")
    return RecordSchema(
        tuple(_field_from_json(f) for f in raw["fields"]),
        name=str(raw.get("name", "")),
        key=tuple(str(k) for k in raw.get("key", ())),
    )
