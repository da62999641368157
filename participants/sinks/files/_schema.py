"""Type mapping of a configured ``schema``: each field type's conversion and Arrow type.

A record is checked against the configured ``{field: type}`` with the SDK's shared conversion
rules (:mod:`twophase.participants.sdk.values`); a value that does not fit refuses the record,
naming the field. Without a configured schema the files sink infers types (:mod:`._arrow`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any

import pyarrow as pa

from twophase.participants.sdk import values

__all__ = ["ARROW_TYPES", "Mismatch", "SchemaCheck"]

#: The Arrow (and so Parquet) type of each configured field type.
ARROW_TYPES: dict[str, Any] = {
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


class Mismatch(ValueError):
    """A value that does not fit its configured field type; names the field."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"field {field_name!r}: {reason}")
        self.field_name = field_name


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


def _to_float(bits: int) -> Callable[[Any], Any]:
    read = values.to_float32 if bits == 32 else values.to_float

    def convert(value: Any) -> Any:
        try:
            return read(value)
        except values.BadValue as exc:
            raise ValueError(str(exc)) from None

    return convert


def _to_bool(value: Any) -> Any:
    try:
        return values.to_bool(value)
    except values.BadValue as exc:
        raise ValueError(str(exc)) from None


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


#: Epoch milliseconds a timestamp column holds: those of the years 1-9999 (Arrow's int64
#: would hold more, but no reader's calendar does).
_MS_RANGE = range(-62_135_596_800_000, 253_402_300_800_000)


def _to_timestamp(value: Any) -> Any:
    """Epoch milliseconds (int) or an ISO-8601 string; naive times are UTC. Never rounded: a
    string with digits below the millisecond is refused (the column holds milliseconds)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in _MS_RANGE:
            raise ValueError(f"epoch milliseconds {value} are outside the years 1-9999")
        return value
    if isinstance(value, str):
        try:
            micros = values.to_instant(value)
        except values.BadValue as exc:
            raise ValueError(f"{exc} (or epoch milliseconds)") from None
        if micros % 1000:
            raise ValueError(
                f"{value!r} has digits below the millisecond, which a timestamp field (ms) "
                "does not hold"
            )
        return micros // 1000
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
    "float32": _to_float(32),
    "float64": _to_float(64),
    "bool": _to_bool,
    "timestamp": _to_timestamp,
    "date": _to_date,
    "json": _to_json,
}


class SchemaCheck:
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
        """The row in schema order; raises :class:`Mismatch` naming the first bad field."""
        if (extra := self.unknown(value)) is not None:
            raise Mismatch(extra, "not in the configured schema")
        row: list[Any] = []
        for name, convert in self.fields:
            raw = value.get(name)
            if raw is None:
                row.append(None)
                continue
            try:
                row.append(convert(raw))
            except ValueError as exc:
                raise Mismatch(name, str(exc)) from None
        return row
