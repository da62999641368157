"""Kafka Connect's JSON converter envelope, ``{"schema": ..., "payload": ...}``.

With ``schemas.enable=true`` (the converter's default) every key and value Kafka Connect writes
-- Debezium's change events among them -- is wrapped this way. :func:`unwrap` returns the
payload with the values whose schema names a logical type turned into the JSON value a sink
maps exactly: a ``Decimal`` (base64 of the unscaled big-endian integer, with the scale in the
schema's parameters) becomes its exact decimal string, dates, times and timestamps -- Kafka
Connect's and Debezium's ``io.debezium.time.*`` -- become ISO-8601 strings (timestamps in UTC).
A value that is not an envelope is returned as it is, so schemaless JSON passes unchanged.

No schema registry is involved: the schema travels in every message.
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

__all__ = ["ConnectError", "is_envelope", "unwrap"]

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
    else as it is. Raises :class:`ConnectError` when the payload contradicts its schema."""
    if not is_envelope(obj):
        return obj
    schema = obj["schema"]
    payload = obj["payload"]
    return payload if schema is None else _convert(schema, payload, "payload")


def _convert(schema: dict[str, Any], value: Any, where: str) -> Any:
    if value is None:
        return None
    name = schema.get("name")
    if name is not None:
        logical = _LOGICAL.get(name)
        if logical is not None:
            try:
                return logical(schema, value)
            except (TypeError, ValueError, OverflowError, binascii.Error) as exc:
                raise ConnectError(f"{where}: not a valid {name}: {value!r} ({exc})") from None
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


def _scale(schema: dict[str, Any]) -> int:
    params = schema.get("parameters") or {}
    return int(params.get("scale", 0))


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
    return _exact(int.from_bytes(raw, "big", signed=True), int(value["scale"]))


def _exact(unscaled: int, scale: int) -> str:
    return str(Decimal(unscaled).scaleb(-scale))


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
