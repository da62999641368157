"""Value formats: how a key's or value's bytes become a Python value, and its schema.

``sources[].value_format`` and ``key_format`` choose one per source (``docs/schemas.md``). A
format only decodes; what the decoded value *means* -- a row, a Debezium change event -- is the
decoder's (``source.format``). Every format yields the one value model the sinks map
(``docs/types.md``): JSON values, with logical types (decimals, dates, times, timestamps,
UUIDs, bytes) as exact JSON values, and, when the format has one, the value's
:class:`~twophase.participants.sdk.RecordSchema` saying what they are.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import orjson

from twophase.config import SchemaRegistryConfig
from twophase.participants.decoding.connect import ConnectError, is_envelope, record_schema
from twophase.participants.decoding.connect import unwrap as unwrap_envelope
from twophase.participants.sdk import RecordSchema

__all__ = [
    "ConnectJsonFormat",
    "FormatResult",
    "JsonFormat",
    "StringFormat",
    "ValueFormat",
    "exact",
    "loads_exact",
    "maybe_wide",
    "value_format",
]

#: orjson decodes an integer outside -2**63 .. 2**64-1 as the nearest double:
#: 18446744073709551617 would become 1.8446744073709552e+19. Any such double is at least this
#: large; a decoded value holding one is decoded again by the standard library, which keeps
#: every integer exact (a float literal this large is decoded again too, to the same value).
#: Looking costs ~0.3 us for a flat ~200-byte record (a regex over the bytes cost ~1.5 us).
_WIDE = 9.2e18


def maybe_wide(obj: dict[str, Any]) -> bool:
    """True when ``obj`` (orjson's decoding) holds a double that may be a rounded integer."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        for v in item.values() if item.__class__ is dict else item:
            kind = v.__class__
            if kind is float:
                if v >= _WIDE or v <= -_WIDE:
                    return True
            elif kind is dict or kind is list:
                stack.append(v)
    return False


def exact(value: bytes, obj: Any) -> Any:
    """``obj`` (orjson's decoding of ``value``, so strict JSON) with integers of any size kept
    exact, or a str saying why it cannot be."""
    if not maybe_wide(obj):
        return obj
    try:
        return json.loads(value)
    except RecursionError:
        return "undecodable: nested too deeply"
    except ValueError as exc:  # an integer past the interpreter's digit limit
        return f"undecodable: {exc}"


def loads_exact(value: bytes) -> tuple[Any, str]:
    """``value`` decoded, integers of any width exact: ``(obj, "")``, or ``(None, why not)``."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        if "number is infinity" not in str(exc):
            return None, f"undecodable: not JSON ({exc})"
        # orjson reads every number as a double first: an integer past ~308 digits fails so.
        return _loads_wide(value, exc)
    kind = obj.__class__
    if kind is dict or kind is list:
        obj = exact(value, obj)
        if obj.__class__ is str:
            return None, obj
    elif kind is float and (obj >= _WIDE or obj <= -_WIDE):
        return json.loads(value), ""
    return obj, ""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"number {text[:40]} is out of a double's range")
    return number


def _valid_text(obj: Any) -> None:
    """Raise ValueError for a string (or key) orjson would have refused: a lone surrogate
    escape (``"\\ud800"``), which the standard library reads."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")  # UnicodeEncodeError is a ValueError
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _loads_wide(value: bytes, exc: Exception) -> tuple[Any, str]:
    """``value`` that orjson refused for a number it read as infinity: read by the standard
    library, which keeps integers exact (up to the interpreter's 4,300 digits); a float past
    a double's range, NaN/Infinity or a lone surrogate is refused as orjson would have."""
    try:
        obj = json.loads(value, parse_float=_finite, parse_constant=_refuse_constant)
        _valid_text(obj)
        return obj, ""
    except RecursionError:
        return None, "undecodable: nested too deeply"
    except UnicodeEncodeError:
        return None, "undecodable: not JSON (a string holds a lone surrogate escape)"
    except ValueError:  # the float, a constant, or an integer past the digit limit
        return None, f"undecodable: not JSON ({exc})"


#: A decoded value and its schema (None when the format has none), or why it did not decode.
FormatResult = tuple[Any, RecordSchema | None] | str


class ValueFormat(ABC):
    """One way a key's or value's bytes decode."""

    name: ClassVar[str]

    @abstractmethod
    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        """``data`` decoded, with its schema; or the reason it is not of this format."""

    def writer_schema(self, schema_id: int) -> str | None:
        """The text of a registry schema a compiled reader may use (Avro only)."""
        return None


class JsonFormat(ValueFormat):
    """JSON text; integers of any width exact. No schema."""

    name = "json"

    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        obj, reason = loads_exact(data)
        return reason or (obj, None)


class StringFormat(ValueFormat):
    """UTF-8 text (a key written by a string serializer)."""

    name = "string"

    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        try:
            return data.decode("utf-8"), None
        except UnicodeDecodeError as exc:
            return f"undecodable: not UTF-8 text ({exc})"


class ConnectJsonFormat(ValueFormat):
    """Kafka Connect's JSON converter with ``schemas.enable``: a ``{schema, payload}``
    envelope, unwrapped (logical types made exact JSON values), its schema kept."""

    name = "connect_json"

    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        obj, reason = loads_exact(data)
        if reason:
            return reason
        if not is_envelope(obj):
            return "undecodable: not a Kafka Connect {schema, payload} envelope"
        try:
            payload: Any = unwrap_envelope(obj)
            schema = record_schema(obj["schema"])
        except ConnectError as exc:
            return f"undecodable: {exc}"
        return payload, schema


def value_format(name: str, registry: SchemaRegistryConfig | None = None) -> ValueFormat:
    """The format a source's ``value_format`` or ``key_format`` names (the config model has
    refused unknown names, and registry formats without a registry)."""
    if name == "connect_json":
        return ConnectJsonFormat()
    if name == "string":
        return StringFormat()
    if name in ("avro", "protobuf", "json_schema"):
        from twophase.participants.decoding.registry import RegistryFormat

        assert registry is not None, "the config requires schema_registry for registry formats"
        return RegistryFormat(name, registry)
    return JsonFormat()
