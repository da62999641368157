"""Registry formats: the Confluent wire format -- a magic byte, the schema's id (or, in the newer
framing, a GUID; in headers or in front of the payload) and, for Protobuf, the message's index
-- with Avro, Protobuf or JSON Schema, decoded with the schema the registry holds under it.

The codecs are the libraries' (fastavro, protobuf, jsonschema); the framing is
confluent-kafka's (:class:`SchemaId`); the registry client is confluent-kafka's, so any
Confluent-compatible registry serves (Confluent Schema Registry, Apicurio Registry's
``/apis/ccompat/v7``, Karapace). What this module adds is the mapping of each format's types to
the one value model the sinks map (``docs/types.md``, ``docs/schemas.md``): logical types as
exact JSON values (a decimal's exact string, ISO-8601 dates and times, timestamps in UTC with
``Z``, UUIDs as text, bytes as base64, a double's NaN and infinities as ``"NaN"``,
``"Infinity"``, ``"-Infinity"``) and each schema as a
:class:`~twophase.participants.sdk.RecordSchema` for the sinks that create or evolve targets.

A schema is fetched once per id and kept with its reader. What cannot be decoded goes to the
dead-letter topic with a named reason -- no wire-format header, an unknown schema id, a schema of
another format, a payload that does not match its schema. A registry that does not answer is
waited for like a store (:data:`twophase.retry.STORE`), then the part fails and is retried: the
pipeline never stops on it.
"""

from __future__ import annotations

import base64
import decimal
import io
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, ClassVar
from uuid import UUID

from twophase.config import SchemaRegistryConfig
from twophase.errors import RetriableError
from twophase.participants.decoding.formats import FormatResult, ValueFormat, loads_exact
from twophase.participants.sdk import Field, FieldType, RecordSchema
from twophase.retry import SINK_RETRY_S, STORE

__all__ = ["RegistryFormat", "RegistryUnavailable", "registry_client"]

log = logging.getLogger("twophase.participant")

#: An object's address in its repr (`<_io.BytesIO object at 0x7f...>`).
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
#: The registry's schema type of each format.
_SCHEMA_TYPES = {"avro": "AVRO", "protobuf": "PROTOBUF", "json_schema": "JSON"}
#: Nesting a schema may have before its deeper parts are kept as ``json`` (a recursive schema,
#: a linked list, would otherwise never end).
_MAX_DEPTH = 32

Convert = Callable[[Any], Any]


class RegistryUnavailable(RetriableError):
    """The schema registry did not answer (or answered with a server error): retried like a
    store, then the part is retried."""


def registry_client(cfg: SchemaRegistryConfig) -> Any:
    """confluent-kafka's client for the configured registry (its own HTTP retries off: ours
    decide, :data:`twophase.retry.STORE`)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    conf: dict[str, Any] = {"url": cfg.url, "max.retries": 0, **cfg.config}
    if cfg.username:
        password = cfg.password.get_secret_value() if cfg.password is not None else ""
        conf["basic.auth.user.info"] = f"{cfg.username}:{password}"
    return SchemaRegistryClient(conf)


@dataclass(frozen=True, slots=True)
class _Reader:
    """One schema's reader: payload bytes -> the value in the model, and the schema (per
    message index, for Protobuf: one schema document may hold several messages)."""

    read: Callable[[io.BytesIO, list[int] | None], Any]
    schema: RecordSchema | None
    schema_for: Callable[[list[int] | None], RecordSchema | None] | None = None
    #: The writer schema's text, for a compiled reader (an Avro record schema without
    #: references); None otherwise.
    text: str | None = None


class _Unknown(Exception):
    """A schema id the registry does not know, or a schema this source cannot read."""


class RegistryFormat(ValueFormat):
    """``avro``, ``protobuf`` or ``json_schema`` through the schema registry."""

    name: ClassVar[str] = "registry"

    def __init__(
        self,
        kind: str,
        registry: SchemaRegistryConfig,
        client: Any = None,
        retry_s: float = SINK_RETRY_S,
    ) -> None:
        self.kind = kind
        #: How long a schema fetch is retried while the registry does not answer: as long as
        #: a sink call (the participant then fails the part, which is read again).
        self.retry_s = retry_s
        self.schema_type = _SCHEMA_TYPES[kind]
        self.registry = registry
        self._client = client
        self._readers: dict[tuple[str, Any], _Reader | str] = {}
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = registry_client(self.registry)
        return self._client

    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        from confluent_kafka.schema_registry.common.serde import SchemaId

        if len(data) < 5 or data[0] not in (0, 1):
            return "undecodable: no schema registry framing (magic byte 0x00 and a schema id)"
        indexes: list[int] | None = None
        if data[0] == 0 and self.schema_type != "PROTOBUF":
            # The common framing, read here: confluent-kafka's reader costs ~2 us a record.
            ref: tuple[str, Any] = ("id", int.from_bytes(data[1:5], "big"))
            payload = io.BytesIO(data)
            payload.seek(5)
        else:
            sid = SchemaId(self.schema_type)
            payload = io.BytesIO(data)
            try:
                sid.from_bytes(payload)
            except Exception as exc:  # noqa: BLE001 - the framing's errors: struct, EOF, its own
                return f"undecodable: bad schema registry framing ({exc})"
            ref = ("id", sid.id) if sid.id is not None else ("guid", str(sid.guid))
            indexes = sid.message_indexes
        reader = self._readers.get(ref)
        if reader is None:
            reader = self._load(ref)
        if isinstance(reader, str):
            return reader
        try:
            value = reader.read(payload, indexes)
        except _Mismatch as exc:
            return f"undecodable: payload does not match its schema ({ref[0]} {ref[1]}): {exc}"
        except Exception as exc:  # noqa: BLE001 - a codec's errors are many and unnamed
            # Without the objects' addresses fastavro's messages carry: one reason, one text.
            said = _ADDRESS.sub(">", str(exc))
            return (
                f"undecodable: payload does not match its schema ({ref[0]} {ref[1]}, "
                f"{self.kind}): {type(exc).__name__}: {said}"
            )
        schema = (
            reader.schema if reader.schema_for is None else reader.schema_for(sid.message_indexes)
        )
        return value, schema

    def writer_schema(self, schema_id: int) -> str | None:
        """The Avro text of schema ``schema_id`` once a value of it was decoded, when a compiled
        reader may read it (a record schema without references)."""
        reader = self._readers.get(("id", schema_id))
        return reader.text if isinstance(reader, _Reader) else None

    def _load(self, ref: tuple[str, Any]) -> _Reader | str:
        """The reader of schema ``ref``, or why there is none (kept: an id's schema never
        changes). Raises :class:`RegistryUnavailable` when the registry does not answer."""
        with self._lock:
            if (known := self._readers.get(ref)) is not None:
                return known
            try:
                schema = STORE.call(
                    lambda: self._fetch(ref),
                    f"fetching schema {ref[0]} {ref[1]}",
                    budget_s=self.retry_s,
                    logger=log,
                )
                reader: _Reader | str = _READERS[self.kind](
                    schema, self.client, f"registry:{ref[0]}:{ref[1]}"
                )
            except _Unknown as exc:
                reader = f"undecodable: {exc}"
            except RetriableError as exc:
                raise RegistryUnavailable(f"schema registry {self.registry.url}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - a schema the codec cannot parse
                reader = f"undecodable: schema {ref[0]} {ref[1]} cannot be read: {exc}"
            if isinstance(reader, _Reader) or reader.startswith("undecodable: schema"):
                self._readers[ref] = reader
            return reader

    def _fetch(self, ref: tuple[str, Any]) -> Any:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        fmt = "serialized" if self.kind == "protobuf" else None
        try:
            if ref[0] == "id":
                schema = self.client.get_schema(ref[1], fmt=fmt)
            else:
                schema = self.client.get_schema_by_guid(ref[1], fmt=fmt)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise _Unknown(f"unknown schema {ref[0]} {ref[1]} in the registry") from None
            if exc.http_status_code >= 500 or exc.http_status_code in (408, 429):
                raise RegistryUnavailable(str(exc)) from exc
            raise _Unknown(f"schema {ref[0]} {ref[1]}: the registry says {exc}") from None
        except (OSError, TimeoutError) as exc:
            raise RegistryUnavailable(str(exc)) from exc
        except Exception as exc:
            if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "h11"):
                raise RegistryUnavailable(f"{type(exc).__name__}: {exc}") from exc
            raise
        schema_type = (schema.schema_type or "AVRO").upper()
        if schema_type != self.schema_type:
            raise _Unknown(
                f"schema {ref[0]} {ref[1]} is {schema_type}, the source reads {self.kind}"
            )
        return schema


class _Mismatch(ValueError):
    """A payload that decoded but breaks its schema (JSON Schema validation)."""


# -- values into the model ---------------------------------------------------------------------


def _float(v: Any) -> Any:
    if v.__class__ is float and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def _decimal(v: Any) -> Any:
    return format(v, "f") if isinstance(v, Decimal) else v


def _decimal_of(precision: int) -> Convert:
    """A decimal of a type that declares ``precision``: its exact text, or refused when it has
    more digits than that (the Avro reader would round it to fit; read exactly here, see
    :func:`_exact_decimal`)."""

    def convert(v: Any) -> Any:
        if isinstance(v, Decimal) and v.is_finite() and len(v.as_tuple().digits) > precision:
            digits = len(v.as_tuple().digits)
            raise _Mismatch(f"decimal {v} has {digits} digits, more than its precision {precision}")
        return _decimal(v)

    return convert


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, date | time) else v


def _instant(v: Any) -> Any:
    if isinstance(v, datetime):
        if v.tzinfo is not None:
            v = v.astimezone(UTC).replace(tzinfo=None)
        return v.isoformat() + "Z"
    return v


def _text(v: Any) -> Any:
    return str(v) if isinstance(v, UUID) else v


def _b64(v: Any) -> Any:
    return base64.b64encode(v).decode("ascii") if isinstance(v, bytes | bytearray) else v


#: The value conversion of each kind; None: the decoded value is already in the model.
_BY_KIND: dict[str, Convert | None] = {
    "float32": _float,
    "float64": _float,
    "decimal": _decimal,
    "date": _iso,
    "time": _iso,
    "timestamp": _instant,
    "timestamp_local": _iso,
    "uuid": _text,
    "bytes": _b64,
}


def _converter(t: FieldType) -> Convert | None:
    """What turns a decoded value of type ``t`` into the model; None when nothing must."""
    if t.kind == "decimal" and t.precision:
        return _nullable(_decimal_of(t.precision))
    if t.kind in _BY_KIND:
        fn = _BY_KIND[t.kind]
        return None if fn is None else _nullable(fn)
    if t.kind == "array" and t.items is not None:
        item = _converter(t.items)
        if item is None:
            return None
        return _nullable(lambda v: [item(x) for x in v])
    if t.kind == "map" and t.values is not None:
        value = _converter(t.values)
        if value is None:
            return None
        return _nullable(lambda v: {k: value(x) for k, x in v.items()})
    if t.kind == "record":
        plan = _plan(t.fields)
        return None if not plan else _nullable(lambda v: _apply(plan, v))
    if t.kind == "json":
        return _any
    return None


def _nullable(fn: Convert) -> Convert:
    return lambda v: None if v is None else fn(v)


def _any(v: Any) -> Any:
    """A value whose type the schema does not name closely (a union of several types)."""
    if isinstance(v, dict):
        return {k: _any(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_any(x) for x in v]
    for fn in (_float, _decimal, _instant, _iso, _text, _b64):
        v = fn(v)
    return v


def _plan(fields: tuple[Field, ...]) -> list[tuple[str, Convert]]:
    return [(f.name, fn) for f in fields if (fn := _converter(f.type)) is not None]


def _apply(plan: list[tuple[str, Convert]], record: dict[str, Any]) -> dict[str, Any]:
    for name, fn in plan:
        if name in record:
            record[name] = fn(record[name])
    return record


def _record_reader(
    decode: Callable[[io.BytesIO, list[int] | None], Any], schema: RecordSchema | None
) -> _Reader:
    """A reader whose value is converted into the model by ``schema``'s plan."""
    if schema is None:
        return _Reader(lambda b, i: _any(decode(b, i)), None)
    plan = _plan(schema.fields)
    if not plan:
        return _Reader(decode, schema)
    return _Reader(lambda b, i: _apply(plan, decode(b, i)), schema)


# -- Avro ---------------------------------------------------------------------------------------

_AVRO_PRIMITIVES = {
    "boolean": "boolean",
    "int": "int32",
    "long": "int64",
    "float": "float32",
    "double": "float64",
    "bytes": "bytes",
    "string": "string",
}
_AVRO_LOGICAL = {
    "date": ("date", None),
    "time-millis": ("time", "ms"),
    "time-micros": ("time", "us"),
    "timestamp-millis": ("timestamp", "ms"),
    "timestamp-micros": ("timestamp", "us"),
    "local-timestamp-millis": ("timestamp_local", "ms"),
    "local-timestamp-micros": ("timestamp_local", "us"),
    "uuid": ("uuid", None),
}


def avro_field_type(
    schema: Any, names: dict[str, Any], nullable: bool = False, depth: int = 0
) -> FieldType:
    """The field type of an Avro schema (``names``: named types seen so far, by full name)."""
    if depth > _MAX_DEPTH:
        return FieldType("json", nullable)
    if isinstance(schema, str):
        if schema in _AVRO_PRIMITIVES:
            return FieldType(_AVRO_PRIMITIVES[schema], nullable)
        if schema in names:
            return avro_field_type(names[schema], names, nullable, depth + 1)
        return FieldType("json", nullable)
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        optional = nullable or len(branches) < len(schema)
        if len(branches) == 1:
            return avro_field_type(branches[0], names, optional, depth + 1)
        return FieldType("json", optional)
    if not isinstance(schema, dict):
        return FieldType("json", nullable)
    kind = schema.get("type")
    name = schema.get("name")
    if isinstance(name, str) and kind in ("record", "enum", "fixed"):
        space = schema.get("namespace")
        names.setdefault(f"{space}.{name}" if space and "." not in name else name, schema)
        names.setdefault(name.rsplit(".", 1)[-1], schema)
    logical = schema.get("logicalType")
    if logical == "decimal" and kind in ("bytes", "fixed"):
        return FieldType(
            "decimal",
            nullable,
            precision=int(schema["precision"]),
            scale=int(schema.get("scale", 0)),
        )
    if logical in _AVRO_LOGICAL:
        k, unit = _AVRO_LOGICAL[logical]
        return FieldType(k, nullable, unit=unit)
    if kind == "record":
        return FieldType("record", nullable, fields=_avro_fields(schema, names, depth + 1))
    if kind == "enum":
        return FieldType("enum", nullable, symbols=tuple(schema.get("symbols", ())))
    if kind == "fixed":
        return FieldType("bytes", nullable)
    if kind == "array":
        return FieldType(
            "array", nullable, items=avro_field_type(schema["items"], names, False, depth + 1)
        )
    if kind == "map":
        return FieldType(
            "map", nullable, values=avro_field_type(schema["values"], names, False, depth + 1)
        )
    return avro_field_type(kind, names, nullable, depth + 1)


def _avro_fields(schema: dict[str, Any], names: dict[str, Any], depth: int) -> tuple[Field, ...]:
    return tuple(
        Field(
            f["name"], avro_field_type(f["type"], names, False, depth), has_default="default" in f
        )
        for f in schema.get("fields", ())
    )


_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def _exact_decimal(data: bytes, writer_schema: Any = None, reader_schema: Any = None) -> Decimal:
    """An Avro decimal as it was written: fastavro's own reader rounds it to the schema's
    precision (a writer should never have written more digits, but one did: 1234.56 in a
    ``decimal(4,2)`` came out as 1235 -- a changed value, silently). Read exactly, the
    model's conversion (:func:`_decimal_of`) refuses it against the declared precision."""
    scale = writer_schema.get("scale", 0) if writer_schema is not None else 0
    unscaled = int.from_bytes(data, byteorder="big", signed=True)
    return Decimal(unscaled).scaleb(-scale, _EXACT)


def _read_decimals_exactly() -> None:
    """Install :func:`_exact_decimal` as fastavro's decimal reader: its documented hook for
    logical types (``fastavro.read.LOGICAL_READERS``), read by every fastavro reader."""
    from fastavro.read import LOGICAL_READERS

    LOGICAL_READERS["bytes-decimal"] = _exact_decimal
    LOGICAL_READERS["fixed-decimal"] = _exact_decimal


def _avro_reader(schema: Any, client: Any, sid: str) -> _Reader:
    from confluent_kafka.schema_registry._sync.avro import _resolve_named_schema
    from fastavro import parse_schema, schemaless_reader

    named = _resolve_named_schema(schema, client)
    raw = json.loads(schema.schema_str)
    parsed = parse_schema(raw, named_schemas=dict(named))  # type: ignore[arg-type]
    _read_decimals_exactly()
    names: dict[str, Any] = {}
    for ref in named.values():
        avro_field_type(ref, names)
    top = avro_field_type(raw, names)
    record = (
        RecordSchema(top.fields, id=sid, name=str(raw.get("name", "")))
        if top.kind == "record"
        else None
    )

    def read(buf: io.BytesIO, _indexes: list[int] | None) -> Any:
        return schemaless_reader(buf, parsed, None)

    reader = _record_reader(read, record)
    if record is None:
        return _Reader(reader.read, None)
    return replace(reader, text=None if named else schema.schema_str)


# -- JSON Schema --------------------------------------------------------------------------------

_JSON_FORMATS = {
    "date": ("date", None),
    "date-time": ("timestamp", "us"),
    "time": ("time", "us"),
    "uuid": ("uuid", None),
}
_CONNECT_TYPES = {
    "int8": "int32",
    "int16": "int32",
    "int32": "int32",
    "int64": "int64",
    "float32": "float32",
    "float64": "float64",
}


def json_field_type(
    schema: Any, root: dict[str, Any], nullable: bool = False, depth: int = 0
) -> FieldType:
    """The field type of a JSON Schema (``$ref`` within the document followed)."""
    if depth > _MAX_DEPTH or not isinstance(schema, dict):
        return FieldType("json", nullable)
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for step in ref[2:].split("/"):
            target = target.get(step, {}) if isinstance(target, dict) else {}
        return json_field_type(target, root, nullable, depth + 1)
    for combo in ("oneOf", "anyOf"):
        options = schema.get(combo)
        if isinstance(options, list):
            real = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            optional = nullable or len(real) < len(options)
            if len(real) == 1:
                return json_field_type(real[0], root, optional, depth + 1)
            return FieldType("json", optional)
    kind = schema.get("type")
    if isinstance(kind, list):
        real_types = [k for k in kind if k != "null"]
        nullable = nullable or len(real_types) < len(kind)
        if len(real_types) != 1:
            return FieldType("json", nullable)
        kind = real_types[0]
    if kind == "integer":
        return FieldType(_CONNECT_TYPES.get(schema.get("connect.type", ""), "int64"), nullable)
    if kind == "number":
        return FieldType(_CONNECT_TYPES.get(schema.get("connect.type", ""), "float64"), nullable)
    if kind == "boolean":
        return FieldType("boolean", nullable)
    if kind == "string":
        fmt = schema.get("format")
        if fmt in _JSON_FORMATS:
            k, unit = _JSON_FORMATS[fmt]
            return FieldType(k, nullable, unit=unit)
        if isinstance(schema.get("enum"), list):
            return FieldType("enum", nullable, symbols=tuple(map(str, schema["enum"])))
        if schema.get("contentEncoding") == "base64":
            return FieldType("bytes", nullable)
        return FieldType("string", nullable)
    if kind == "array":
        return FieldType(
            "array", nullable, items=json_field_type(schema.get("items"), root, False, depth + 1)
        )
    if kind == "object":
        props = schema.get("properties")
        if isinstance(props, dict):
            return FieldType("record", nullable, fields=_json_fields(schema, root, depth + 1))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return FieldType("map", nullable, values=json_field_type(extra, root, False, depth + 1))
    return FieldType("json", nullable)


def _json_fields(schema: dict[str, Any], root: dict[str, Any], depth: int) -> tuple[Field, ...]:
    required = set(schema.get("required", ()))
    return tuple(
        Field(
            name,
            json_field_type(sub, root, name not in required, depth),
            has_default=isinstance(sub, dict) and "default" in sub,
        )
        for name, sub in schema["properties"].items()
    )


def _json_reader(schema: Any, client: Any, sid: str) -> _Reader:
    import jsonschema

    raw = json.loads(schema.schema_str)
    if schema.references:
        raise _Unknown("JSON Schema references to other subjects are not supported")
    validator_class = jsonschema.validators.validator_for(raw)
    validator_class.check_schema(raw)
    validator = validator_class(raw, format_checker=validator_class.FORMAT_CHECKER)
    top = json_field_type(raw, raw)
    record = (
        RecordSchema(top.fields, id=sid, name=str(raw.get("title", "")))
        if top.kind == "record"
        else None
    )

    def read(buf: io.BytesIO, _indexes: list[int] | None) -> Any:
        value, reason = loads_exact(buf.read())
        if reason:
            raise _Mismatch(reason.removeprefix("undecodable: "))
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(root)"
            raise _Mismatch(f"{where}: {error.message}")
        return value

    return _Reader(read, record)


# -- Protobuf -----------------------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1)


def _proto_types() -> dict[int, str]:
    from google.protobuf.descriptor import FieldDescriptor as F

    return {
        F.TYPE_INT32: "int32",
        F.TYPE_SINT32: "int32",
        F.TYPE_SFIXED32: "int32",
        F.TYPE_UINT32: "int64",
        F.TYPE_FIXED32: "int64",
        F.TYPE_INT64: "int64",
        F.TYPE_SINT64: "int64",
        F.TYPE_SFIXED64: "int64",
        F.TYPE_FLOAT: "float32",
        F.TYPE_DOUBLE: "float64",
        F.TYPE_BOOL: "boolean",
        F.TYPE_STRING: "string",
        F.TYPE_BYTES: "bytes",
    }


_WRAPPERS = {
    "google.protobuf.DoubleValue": "float64",
    "google.protobuf.FloatValue": "float32",
    "google.protobuf.Int64Value": "int64",
    "google.protobuf.UInt64Value": "uint64",
    "google.protobuf.Int32Value": "int32",
    "google.protobuf.UInt32Value": "int64",
    "google.protobuf.BoolValue": "boolean",
    "google.protobuf.StringValue": "string",
    "google.protobuf.BytesValue": "bytes",
}


@dataclass(frozen=True, slots=True)
class _ProtoField:
    name: str
    type: FieldType
    read: Convert


def _proto_field(fd: Any, depth: int) -> _ProtoField:
    """A message field's type, and what reads its value out of a message into the model."""
    from google.protobuf.descriptor import FieldDescriptor as F

    name = fd.name
    # protobuf >= 6 has is_repeated; older ones only the label.
    repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == F.LABEL_REPEATED
    if fd.type == F.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
        value_fd = fd.message_type.fields_by_name["value"]
        inner = _proto_value(value_fd, depth + 1)
        return _ProtoField(
            name,
            FieldType("map", False, values=inner[0]),
            lambda m: {str(k): inner[1](v) for k, v in getattr(m, name).items()},
        )
    element = _proto_value(fd, depth + 1)
    if repeated:
        return _ProtoField(
            name,
            # An element is never null (protobuf has no null in a repeated field).
            FieldType("array", False, items=replace(element[0], nullable=False)),
            lambda m: [element[1](v) for v in getattr(m, name)],
        )
    has_presence = fd.has_presence
    t = element[0]
    if has_presence and not t.nullable:
        t = FieldType(
            t.kind, True, t.precision, t.scale, t.unit, t.items, t.values, t.fields, t.symbols
        )
    read = element[1]
    if has_presence:
        return _ProtoField(name, t, lambda m: read(getattr(m, name)) if m.HasField(name) else None)
    return _ProtoField(name, t, lambda m: read(getattr(m, name)))


def _proto_value(fd: Any, depth: int) -> tuple[FieldType, Convert]:
    """The type of one value of field ``fd`` (an element, for a repeated field) and its
    conversion into the model."""
    from google.protobuf.descriptor import FieldDescriptor as F

    if fd.type == F.TYPE_ENUM:
        enum = fd.enum_type
        names = {v.number: v.name for v in enum.values}
        return FieldType("enum", symbols=tuple(v.name for v in enum.values)), lambda v: names.get(
            v, str(v)
        )
    if fd.type == F.TYPE_MESSAGE:
        return _proto_message_type(fd.message_type, depth)
    if fd.type == F.TYPE_UINT64 or fd.type == F.TYPE_FIXED64:
        # Beyond int64: an exact decimal of 20 digits.
        return FieldType("decimal", precision=20, scale=0), str
    kind = _proto_types()[fd.type]
    convert: Convert
    if kind == "bytes":
        convert = _b64
    elif kind in ("float32", "float64"):
        convert = _float
    else:
        convert = _identity
    return FieldType(kind), convert


def _identity(v: Any) -> Any:
    return v


def _proto_message_type(desc: Any, depth: int) -> tuple[FieldType, Convert]:
    full = desc.full_name
    if full == "google.protobuf.Timestamp":

        def ts(m: Any) -> str:
            if m.nanos % 1000:
                raise _Mismatch(f"timestamp {m.seconds}.{m.nanos:09d} has nanoseconds")
            return (
                _EPOCH + timedelta(seconds=m.seconds, microseconds=m.nanos // 1000)
            ).isoformat() + "Z"

        return FieldType("timestamp", True, unit="us"), ts
    if full == "google.type.Date":
        return FieldType("date", True), lambda m: date(m.year, m.month, m.day).isoformat()
    if full == "google.type.TimeOfDay":

        def tod(m: Any) -> str:
            if m.nanos % 1000:
                raise _Mismatch("time of day has nanoseconds")
            return time(m.hours, m.minutes, m.seconds, m.nanos // 1000).isoformat()

        return FieldType("time", True, unit="us"), tod
    if full == "confluent.type.Decimal":

        def dec(m: Any) -> str:
            unscaled = int.from_bytes(m.value, "big", signed=True)
            return format(Decimal(unscaled).scaleb(-m.scale), "f")

        return FieldType("decimal", True), dec
    if full in _WRAPPERS:
        kind = _WRAPPERS[full]
        if kind == "uint64":
            return FieldType("decimal", True, precision=20, scale=0), lambda m: str(m.value)
        inner: Convert = (
            _b64 if kind == "bytes" else (_float if kind.startswith("float") else _identity)
        )
        return FieldType(kind, True), lambda m: inner(m.value)
    if full in ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"):
        from google.protobuf.json_format import MessageToDict

        return FieldType("json", True), lambda m: MessageToDict(m)
    if depth > _MAX_DEPTH:
        from google.protobuf.json_format import MessageToDict

        return FieldType("json", True), lambda m: MessageToDict(m, preserving_proto_field_name=True)
    fields = [_proto_field(f, depth + 1) for f in desc.fields]

    def read(m: Any) -> dict[str, Any]:
        return {f.name: f.read(m) for f in fields}

    return FieldType("record", True, fields=tuple(Field(f.name, f.type) for f in fields)), read


def _proto_files(name: str, schema_str: str, refs: dict[str, str]) -> list[Any]:
    """The ``FileDescriptorProto`` of a registered Protobuf schema and of what it imports, in
    the order a pool takes them. The registry gives a schema back as it was registered: the
    base64 of a descriptor (confluent-kafka's Python serializer) or ``.proto`` text (Java's),
    which protoc (grpcio-tools) compiles -- no hand-written parser."""
    from google.protobuf import descriptor_pb2

    try:
        fd = descriptor_pb2.FileDescriptorProto()
        fd.ParseFromString(base64.b64decode(schema_str, validate=True))
        if fd.name or fd.message_type:
            fd.name = fd.name or name
            return [fd]
    except Exception:  # noqa: BLE001, S110 - not a descriptor: .proto text
        pass
    import tempfile
    from pathlib import Path

    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="twophase-proto-") as tmp:
        root = Path(tmp)
        for ref_name, text in {**refs, name: schema_str}.items():
            path = root / ref_name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        out = root / "set.pb"
        include = Path(grpc_tools.__file__).parent / "_proto"
        code = protoc.main(
            [
                "protoc",
                f"-I{root}",
                f"-I{include}",
                "--include_imports",
                f"--descriptor_set_out={out}",
                name,
            ]
        )
        if code != 0 or not out.exists():
            raise _Unknown(f"Protobuf schema {name} does not compile (protoc exit {code})")
        files = descriptor_pb2.FileDescriptorSet()
        files.ParseFromString(out.read_bytes())
        return list(files.file)


def _proto_reader(schema: Any, client: Any, sid: str) -> _Reader:
    from confluent_kafka.schema_registry.common.protobuf import _init_pool
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message_factory import GetMessageClass

    pool = DescriptorPool()
    _init_pool(pool)
    refs = {
        ref.name: client.get_version(ref.subject, ref.version, fmt="serialized").schema.schema_str
        for ref in schema.references or ()
    }
    files = _proto_files("main.proto", schema.schema_str, refs)
    for ref_name, text in refs.items():
        if not text.lstrip().startswith(("syntax", "package", "import", "message", "//")):
            files = [*_proto_files(ref_name, text, {}), *files]
    for fd in files:
        try:
            pool.FindFileByName(fd.name)
        except KeyError:
            pool.Add(fd)
    fd_proto = files[-1]
    file_desc = pool.FindFileByName(fd_proto.name)
    by_index: dict[tuple[int, ...], tuple[Any, RecordSchema, Callable[[Any], dict[str, Any]]]] = {}

    def message(
        indexes: list[int] | None,
    ) -> tuple[Any, RecordSchema, Callable[[Any], dict[str, Any]]]:
        key = tuple(indexes or [0])
        known = by_index.get(key)
        if known is None:
            desc = file_desc.message_types_by_name[list(file_desc.message_types_by_name)[key[0]]]
            for i in key[1:]:
                desc = desc.nested_types[i]
            t, read = _proto_message_type(desc, 0)
            at = ".".join(map(str, key))
            record = RecordSchema(t.fields, id=f"{sid}:{at}", name=desc.full_name)
            known = by_index[key] = (GetMessageClass(desc), record, read)
        return known

    if not file_desc.message_types_by_name:
        raise _Unknown(f"schema {sid} defines no message")
    message([0])  # a schema this module cannot map fails here, as unreadable, not per payload

    def read(buf: io.BytesIO, indexes: list[int] | None) -> Any:
        cls, _record, convert = message(indexes)
        m = cls()
        m.ParseFromString(buf.read())
        return convert(m)

    return _Reader(read, None, schema_for=lambda indexes: message(indexes)[1])


_READERS: dict[str, Callable[[Any, Any, str], _Reader]] = {
    "avro": _avro_reader,
    "json_schema": _json_reader,
    "protobuf": _proto_reader,
}
