"""Kafka Connect's JSON converter envelope, ``{"schema": ..., "payload": ...}``.

With ``schemas.enable=true`` (the converter's default) every key and value Kafka Connect writes
-- Debezium's change events among them -- is wrapped this way. :func:`unwrap` returns the
payload with the values whose schema names a logical type turned into the JSON value a sink
maps exactly: a ``Decimal`` (base64 of the unscaled big-endian integer, with the scale in the
schema's parameters) becomes its exact decimal string, dates, times and timestamps -- Kafka
Connect's and Debezium's ``io.debezium.time.*`` -- become ISO-8601 strings (timestamps in UTC).
A value that is not an envelope is returned as it is, so schemaless JSON passes unchanged.

No schema registry is involved: the schema travels in every message. :func:`record_schema` turns
it into the record's :class:`~twophase.participants.sdk.RecordSchema` (cached: a producer sends
the same schema with every message), for sinks that create or evolve their targets from it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from datetime import UTC, date, datetime, timedelta
from typing import Any

import orjson

from twophase.participants.sdk import Field, FieldType, RecordSchema

__all__ = ["ConnectError", "field_schema", "is_envelope", "record_schema", "unwrap"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DAY = date(1970, 1, 1)


class ConnectError(ValueError):
    """A payload that does not match its schema; the message is the reason."""


def is_envelope(obj: Any) -> bool:
    """``obj`` is exactly ``{"schema": <object or null>, "payload": ...}``."""
    return (
        obj.__class__ is dict
        and len(obj) == 2
        and "payload" in obj
        and "schema" in obj
        and (obj["schema"] is None or obj["schema"].__class__ is dict)
    )


def unwrap(obj: Any) -> Any:
    """The payload of a Connect envelope, its logical types made exact JSON values; anything
    else as it is. Raises :class:`ConnectError` when the payload contradicts its schema or
    the schema is malformed -- whatever the message holds, never another exception."""
    if not is_envelope(obj):
        return obj
    schema = obj["schema"]
    payload = obj["payload"]
    if schema is None:
        return payload
    try:
        return _convert(schema, payload, "payload")
    except ConnectError:
        raise
    except Exception as exc:  # noqa: BLE001 - the schema travels in the message: any shape
        raise _malformed("schema", exc) from None


def _malformed(where: str, exc: Exception) -> ConnectError:
    """A schema whose shape Connect would never write (a list where a name goes, a struct's
    fields not a list, nesting past Python's recursion limit, a parameter not a number)."""
    said = str(exc)
    said = said if len(said) <= 200 else said[:200] + "..."
    return ConnectError(f"{where}: malformed Kafka Connect schema ({type(exc).__name__}: {said})")


def _convert(schema: dict[str, Any], value: Any, where: str) -> Any:
    if value is None:
        return None
    name = schema.get("name")
    if name is not None:
        logical = _LOGICAL.get(name)
        if logical is not None:
            try:
                return logical(schema, value)
            except (
                TypeError,
                ValueError,
                OverflowError,
                ArithmeticError,
                KeyError,
                AttributeError,
                binascii.Error,
            ) as exc:
                shown = repr(value)
                shown = shown if len(shown) <= 200 else shown[:200] + "..."
                raise ConnectError(f"{where}: not a valid {name}: {shown} ({exc!r})") from None
    kind = schema.get("type")
    if kind == "struct" and value.__class__ is dict:
        fields = {f.get("field"): f for f in schema.get("fields") or () if f.__class__ is dict}
        return {
            k: _convert(fields[k], v, f"{where}.{k}") if k in fields else v
            for k, v in value.items()
        }
    if kind == "array" and value.__class__ is list and schema.get("items").__class__ is dict:
        items = schema["items"]
        return [_convert(items, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "map" and value.__class__ is dict and schema.get("values").__class__ is dict:
        values = schema["values"]
        return {k: _convert(values, v, f"{where}.{k}") for k, v in value.items()}
    return value


#: The widest scale a decimal may declare: PostgreSQL's ``numeric`` display scale. Wider is no
#: decimal any sink stores, and would spell as a string of that many digits.
MAX_SCALE = 16383


def _scale(schema: dict[str, Any]) -> int:
    params = schema.get("parameters") or {}
    return _bounded_scale(int(params.get("scale", 0)))


def _bounded_scale(scale: int) -> int:
    if not -MAX_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"scale {scale} is out of range (at most {MAX_SCALE} either way)")
    return scale


def _decimal(schema: dict[str, Any], value: Any) -> str:
    """Connect's Decimal: base64 of the two's-complement big-endian unscaled integer."""
    if value.__class__ is not str:
        raise TypeError("expected base64 text")
    unscaled = int.from_bytes(base64.b64decode(value, validate=True), "big", signed=True)
    return _exact(unscaled, _scale(schema))


def _variable_decimal(_schema: dict[str, Any], value: Any) -> str:
    """Debezium's VariableScaleDecimal: a struct ``{scale, value}``, value as Connect's."""
    if value.__class__ is not dict:
        raise TypeError("expected a struct {scale, value}")
    raw = base64.b64decode(value["value"], validate=True)
    return _exact(int.from_bytes(raw, "big", signed=True), _bounded_scale(int(value["scale"])))


def _exact(unscaled: int, scale: int) -> str:
    """The decimal's exact text in plain notation (``0.0000000001``, not ``1E-10``): the
    spelling the registry formats' decimals have, so a text column gets one form."""
    sign = "-" if unscaled < 0 else ""
    digits = str(abs(unscaled))
    if scale <= 0:
        return sign + digits + "0" * -scale if unscaled else "0"
    digits = digits.rjust(scale + 1, "0")
    return f"{sign}{digits[:-scale]}.{digits[-scale:]}"


def _days(_schema: dict[str, Any], value: Any) -> str:
    return (_EPOCH_DAY + timedelta(days=_int(value))).isoformat()


def _since_midnight(divisor: int) -> Any:
    def convert(_schema: dict[str, Any], value: Any) -> str:
        micros = _int(value) * 1_000_000 // divisor
        if not 0 <= micros < 86_400_000_000:
            raise ValueError("outside a day")
        t = (datetime.min + timedelta(microseconds=micros)).time()
        return t.isoformat()

    return convert


def _since_epoch(divisor: int) -> Any:
    def convert(_schema: dict[str, Any], value: Any) -> str:
        micros = _int(value) * 1_000_000 // divisor
        return (_EPOCH + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")

    return convert


def _as_is(_schema: dict[str, Any], value: Any) -> Any:
    return value


def _int(value: Any) -> int:
    if value.__class__ is not int:
        raise TypeError("expected an integer")
    return int(value)


#: Logical type name -> conversion. Zoned types (``io.debezium.time.ZonedTimestamp``) are ISO
#: strings already and pass as they are.
_LOGICAL: dict[str, Any] = {
    "org.apache.kafka.connect.data.Decimal": _decimal,
    "io.debezium.data.VariableScaleDecimal": _variable_decimal,
    "org.apache.kafka.connect.data.Date": _days,
    "io.debezium.time.Date": _days,
    "org.apache.kafka.connect.data.Time": _since_midnight(1_000),
    "io.debezium.time.Time": _since_midnight(1_000),
    "io.debezium.time.MicroTime": _since_midnight(1_000_000),
    "io.debezium.time.NanoTime": _since_midnight(1_000_000_000),
    "org.apache.kafka.connect.data.Timestamp": _since_epoch(1_000),
    "io.debezium.time.Timestamp": _since_epoch(1_000),
    "io.debezium.time.MicroTimestamp": _since_epoch(1_000_000),
    "io.debezium.time.NanoTimestamp": _since_epoch(1_000_000_000),
    "io.debezium.time.ZonedTimestamp": _as_is,
    "io.debezium.time.ZonedTime": _as_is,
}


# -- the schema as a RecordSchema ------------------------------------------------------------

_PRIMITIVE_KINDS = {
    "int8": "int32",
    "int16": "int32",
    "int32": "int32",
    "int64": "int64",
    "float32": "float32",
    "float64": "float64",
    "boolean": "boolean",
    "string": "string",
    "bytes": "bytes",
}


def _logical_type(name: str, schema: dict[str, Any], nullable: bool) -> FieldType | None:
    """The field type of a Connect or Debezium logical type, by the same names as
    :data:`_LOGICAL` (values arrive converted by it)."""
    params = schema.get("parameters") or {}
    if name == "org.apache.kafka.connect.data.Decimal":
        precision = params.get("connect.decimal.precision")
        return FieldType(
            "decimal",
            nullable,
            precision=int(precision) if precision else None,
            scale=_scale(schema),
        )
    if name == "io.debezium.data.VariableScaleDecimal":
        return FieldType("decimal", nullable)  # any precision and scale: unconstrained numeric
    if name in ("org.apache.kafka.connect.data.Date", "io.debezium.time.Date"):
        return FieldType("date", nullable)
    if name in ("org.apache.kafka.connect.data.Time", "io.debezium.time.Time"):
        return FieldType("time", nullable, unit="ms")
    if name in ("io.debezium.time.MicroTime", "io.debezium.time.NanoTime"):
        return FieldType("time", nullable, unit="us")  # nanoseconds arrive cut to micros
    if name in ("org.apache.kafka.connect.data.Timestamp", "io.debezium.time.Timestamp"):
        return FieldType("timestamp", nullable, unit="ms")
    if name in (
        "io.debezium.time.MicroTimestamp",
        "io.debezium.time.NanoTimestamp",
        "io.debezium.time.ZonedTimestamp",
    ):
        return FieldType("timestamp", nullable, unit="us")
    if name == "io.debezium.data.Uuid":
        return FieldType("uuid", nullable)
    if name == "io.debezium.data.Json":
        return FieldType("json", nullable)
    if name == "io.debezium.data.Enum":
        allowed = str(params.get("allowed", ""))
        return FieldType("enum", nullable, symbols=tuple(a for a in allowed.split(",") if a))
    return None


def field_schema(schema: dict[str, Any]) -> FieldType:
    """The field type of one Connect schema (``{type, optional, name, parameters, ...}``);
    a type it cannot name more closely is ``json``."""
    nullable = bool(schema.get("optional"))
    name = schema.get("name")
    if name.__class__ is str and (logical := _logical_type(name, schema, nullable)) is not None:
        return logical
    kind = schema.get("type")
    if kind in _PRIMITIVE_KINDS:
        return FieldType(_PRIMITIVE_KINDS[kind], nullable)
    if kind == "array" and schema.get("items").__class__ is dict:
        return FieldType("array", nullable, items=field_schema(schema["items"]))
    if kind == "map" and schema.get("values").__class__ is dict:
        keys = schema.get("keys")
        if keys.__class__ is dict and keys.get("type") == "string":
            return FieldType("map", nullable, values=field_schema(schema["values"]))
    if kind == "struct":
        return FieldType("record", nullable, fields=_fields(schema))
    return FieldType("json", nullable)


def _fields(schema: dict[str, Any]) -> tuple[Field, ...]:
    return tuple(
        Field(str(f["field"]), field_schema(f), has_default="default" in f)
        for f in schema.get("fields") or ()
        if f.__class__ is dict and f.get("field").__class__ is str
    )


#: Schemas seen, by their JSON text: a producer sends the same one with every message.
_SCHEMAS: dict[bytes, RecordSchema | None] = {}
#: Distinct schemas kept; past it the cache starts again (a topic has a handful of versions).
_SCHEMAS_KEPT = 1024


def record_schema(schema: dict[str, Any] | None, field: str = "") -> RecordSchema | None:
    """The record schema of a Connect ``struct`` schema -- or of its struct field ``field``
    (``after`` of a Debezium envelope) -- None when it is not one."""
    if schema is None:
        return None
    try:
        return _record_schema(schema, field)
    except Exception as exc:  # noqa: BLE001 - the schema travels in the message: any shape
        raise _malformed("schema", exc) from None


def _record_schema(schema: dict[str, Any], field: str) -> RecordSchema | None:
    text = orjson.dumps(schema)
    key = text + field.encode()
    if (known := _SCHEMAS.get(key, False)) is not False:
        return known  # type: ignore[return-value]
    struct: Any = schema
    if field:
        struct = next(
            (
                f
                for f in schema.get("fields") or ()
                if f.__class__ is dict and f.get("field") == field
            ),
            None,
        )
    out = None
    if struct.__class__ is dict and struct.get("type") == "struct":
        digest = hashlib.sha1(key, usedforsecurity=False).hexdigest()[:16]
        out = RecordSchema(
            _fields(struct), id=f"connect:{digest}", name=str(struct.get("name") or "")
        )
    if len(_SCHEMAS) >= _SCHEMAS_KEPT:
        _SCHEMAS.clear()
    _SCHEMAS[key] = out
    return out
