"""BSON typed by a record's schema (``docs/types.md``, "From a record's schema").

A record that carries a :class:`~twophase.participants.sdk.RecordSchema` has each field its
schema names stored as the BSON type of its kind, read exactly by the SDK's shared rules
(:mod:`twophase.participants.sdk.values`); a value that has no exact form is refused, naming the
field. Fields the schema does not name (the record key's fields, Debezium's ``add_fields``)
keep the schemaless rules, and so does every record without a schema. One BSON type per kind
and unit, never per value, so that a query or an index on a field sees every document:

* ``decimal`` -> ``Decimal128`` at the schema's scale (``1.5`` in ``decimal(10,2)`` is
  ``1.50``), refused past 34 digits (Decimal128's own limit);
* ``date`` -> a BSON date at midnight UTC;
* ``timestamp[ms]`` -> a BSON date; ``timestamp[us]`` (any unit but ``ms``) -> its exact text in
  UTC, ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (fixed width: strings sort as the instants do), because a
  BSON date holds milliseconds and Debezium's ``MicroTimestamp`` values have microseconds;
  ``timestamp_local`` the same, without the ``Z`` (a BSON date holding the wall-clock time);
* ``time`` -> ``HH:MM:SS.ffffff`` (BSON has no time of day);
* ``bytes`` -> BSON binary (subtype 0); ``uuid`` -> BSON UUID (binary subtype 4);
* ``int64`` -> ``long`` even when small (``int32`` -> ``int``); ``float32``/``float64`` -> double;
* ``array``, ``map``, ``record`` -> arrays and documents, their values by the same rules (a
  record's fields its schema does not name kept as they are); ``json``, ``string``, ``enum``,
  ``boolean`` -> as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
from bson.binary import Binary

from twophase.participants.sdk import FieldType, RecordSchema, values

__all__ = ["DECIMAL128_DIGITS", "TypedDocuments"]

#: Digits of a BSON Decimal128 (IEEE 754 decimal128).
DECIMAL128_DIGITS = 34
#: Compiled schemas kept (a topic has a handful of versions).
_KEPT = 1024
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_LOCAL = datetime(1970, 1, 1)

Convert = Callable[[Any], Any]


def _string(value: Any) -> Any:
    if value.__class__ is not str:
        raise values.wrong(value, "a string")
    return value


def _integer(bits: int) -> Convert:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    name = f"int{bits}"
    if bits == 32:
        return lambda value: values.to_integer(value, low, high, name)
    return lambda value: bson.Int64(values.to_integer(value, low, high, name))


def _decimal(t: FieldType) -> Convert:
    precision, scale = t.precision, t.scale

    def convert(value: Any) -> Any:
        number = values.fit_decimal(values.to_decimal(value), precision, scale)
        digits = len(number.as_tuple().digits)
        if digits > DECIMAL128_DIGITS:
            raise values.BadValue(
                f"{number if digits <= 60 else 'a number'} has {digits} digits; a BSON "
                f"Decimal128 holds at most {DECIMAL128_DIGITS}"
            )
        try:
            return bson.Decimal128(number)
        except (ValueError, ArithmeticError) as exc:  # an exponent past Decimal128's range
            raise values.BadValue(f"{number} has no exact BSON Decimal128: {exc}") from None

    return convert


def _date(value: Any) -> Any:
    day = values.to_date(value)
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _time(value: Any) -> Any:
    micros = values.to_time(value)
    seconds, fraction = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}.{fraction:06d}"


def _instant(*, local: bool, millis: bool) -> Convert:
    epoch = _EPOCH_LOCAL if local else _EPOCH
    suffix = "" if local else "Z"

    def convert(value: Any) -> Any:
        micros = values.to_instant(value, local=local)
        try:
            moment = epoch + timedelta(microseconds=micros)
        except OverflowError:
            raise values.wrong(value, "an instant within the years 1-9999 in UTC") from None
        if not millis:
            return moment.replace(tzinfo=None).isoformat(timespec="microseconds") + suffix
        if micros % 1000:
            raise values.BadValue(
                f"{value!r} has digits below the millisecond, which its schema's unit (ms) "
                "does not have"
            )
        return moment if not local else moment.replace(tzinfo=UTC)

    return convert


def _uuid(value: Any) -> Any:
    return Binary.from_uuid(values.to_uuid(value))


def _bytes(value: Any) -> Any:
    return Binary(values.from_base64(value), 0)


def _as_is(value: Any) -> Any:
    return value


def converter(t: FieldType) -> Convert:
    """The function that reads a (non-null) value of type ``t`` into its BSON value, exactly;
    raises a ValueError with the reason (and, nested, where)."""
    kind = t.kind
    if kind == "decimal":
        return _decimal(t)
    if kind in ("timestamp", "timestamp_local"):
        return _instant(local=kind == "timestamp_local", millis=t.unit == "ms")
    if kind == "array":
        if t.items is None:
            return _as_is
        return values.array_of(converter(t.items))
    if kind == "map":
        if t.values is None:
            return _as_is
        inner = converter(t.values)

        def mapping(value: Any) -> Any:
            if value.__class__ is not dict:
                raise values.wrong(value, "an object (a map)")
            out = {}
            for k, x in value.items():
                try:
                    out[k] = None if x is None else inner(x)
                except ValueError as exc:
                    raise values.nested(f".{k}", exc) from None
            return out

        return mapping
    if kind == "record":
        fields = {f.name: converter(f.type) for f in t.fields}

        def record(value: Any) -> Any:
            if value.__class__ is not dict:
                raise values.wrong(value, "an object (a record)")
            return _fields(fields, value, ".")

        return record
    simple = _CONVERTERS.get(kind)
    if simple is None:
        raise ValueError(f"no BSON type for kind {kind!r}")
    return simple


def _fields(fields: Mapping[str, Convert], value: Mapping[str, Any], sep: str) -> dict[str, Any]:
    """``value`` with each field ``fields`` names converted; the others as they are."""
    out = {}
    for k, x in value.items():
        convert = fields.get(k)
        if convert is None or x is None:
            out[k] = x
            continue
        try:
            out[k] = convert(x)
        except ValueError as exc:
            raise values.nested(f"{sep}{k}", exc) from None
    return out


_CONVERTERS: dict[str, Convert] = {
    "boolean": values.to_bool,
    "int32": _integer(32),
    "int64": _integer(64),
    "float32": values.to_float,
    "float64": values.to_float,
    "string": _string,
    "enum": _string,
    "uuid": _uuid,
    "bytes": _bytes,
    "date": _date,
    "time": _time,
    "json": _as_is,
}


class TypedDocuments:
    """Converts a record's value by its schema (compiled once per schema)."""

    def __init__(self) -> None:
        self._compiled: dict[Hashable, dict[str, Convert]] = {}

    def convert(self, value: Mapping[str, Any], schema: RecordSchema) -> dict[str, Any]:
        """``value`` with every field ``schema`` names as its BSON type; ValueError (its
        message names the field) when one has no exact form."""
        key: Hashable = schema.id or schema
        fields = self._compiled.get(key)
        if fields is None:
            fields = {f.name: converter(f.type) for f in schema}
            if len(self._compiled) >= _KEPT:
                self._compiled.clear()
            self._compiled[key] = fields
        try:
            return _fields(fields, value, "")
        except values.Nested as exc:
            raise ValueError(f"field {exc.where!r}: {exc.reason}") from None
