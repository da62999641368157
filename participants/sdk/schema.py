"""Record schemas: the types a source says its values have, for sinks that make or change their
targets from them.

A source with a schema -- a registry format (Avro, Protobuf, JSON Schema) or a Kafka Connect
``{schema, payload}`` envelope -- gives each record a :class:`RecordSchema` beside its value
(:attr:`Record.schema`). The value itself stays in the one value model every sink already maps
(``docs/types.md``): logical types arrive as exact JSON values (a decimal as its exact decimal
string, a date or timestamp as ISO-8601, bytes as base64), and the schema says what they are, so
a sink can create a ``numeric(10, 2)`` column, a Parquet ``decimal128(10, 2)`` field or a BSON
``Decimal128`` from them.

:func:`compare` is the one rule for schema changes (``auto_evolve``): which changes a target may
follow (a field added, a type widened) and which it must refuse (a field dropped that the target
requires, a type narrowed), with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

__all__ = [
    "KINDS",
    "Change",
    "Field",
    "FieldType",
    "RecordSchema",
    "compare",
    "widens",
]

#: The kinds of value a schema can name, in the schema-neutral vocabulary every sink maps
#: (``docs/schemas.md`` has the table from Avro, Protobuf and JSON Schema, and to each store).
KINDS = frozenset(
    {
        "boolean",
        "int32",
        "int64",
        "float32",
        "float64",
        "decimal",  # precision, scale; the value is the exact decimal string
        "string",
        "bytes",  # the value is base64
        "uuid",  # the value is the canonical string
        "enum",  # symbols; the value is the symbol
        "date",  # ISO-8601 date
        "time",  # unit ms|us; ISO-8601 time of day
        "timestamp",  # unit ms|us; ISO-8601 with an offset (an instant, UTC)
        "timestamp_local",  # unit ms|us; ISO-8601 without an offset (a wall-clock time)
        "array",  # items
        "map",  # values; string keys
        "record",  # fields
        "json",  # any JSON value (a type the source cannot name more closely)
    }
)

#: Kinds a target may widen to without losing a value: (from, to).
_WIDENINGS = frozenset(
    {
        ("int32", "int64"),
        ("int32", "float64"),
        ("int32", "decimal"),
        ("int64", "decimal"),
        ("float32", "float64"),
        ("enum", "string"),
        ("uuid", "string"),
    }
)


@dataclass(frozen=True, slots=True)
class FieldType:
    """One value's type. ``nullable`` is true when null is a legal value (an Avro union with
    null, a Protobuf ``optional``, a JSON Schema type list with ``"null"``)."""

    kind: str
    nullable: bool = False
    precision: int | None = None
    scale: int | None = None
    #: ``ms`` or ``us`` for times and timestamps: what the source can represent.
    unit: str | None = None
    items: FieldType | None = None
    values: FieldType | None = None
    fields: tuple[Field, ...] = ()
    symbols: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")

    def describe(self) -> str:
        """Short and unambiguous, for reasons and logs: ``decimal(10,2)?``."""
        if self.kind == "decimal":
            text = f"decimal({self.precision},{self.scale})"
        elif self.kind == "array" and self.items is not None:
            text = f"array<{self.items.describe()}>"
        elif self.kind == "map" and self.values is not None:
            text = f"map<{self.values.describe()}>"
        elif self.unit is not None:
            text = f"{self.kind}[{self.unit}]"
        else:
            text = self.kind
        return text + ("?" if self.nullable else "")


@dataclass(frozen=True, slots=True)
class Field:
    """A named field of a record. ``has_default``: a reader of an older schema may miss it."""

    name: str
    type: FieldType
    has_default: bool = False

    @property
    def optional(self) -> bool:
        """A record may leave it out or null it: a target column for it must take NULL."""
        return self.type.nullable or self.has_default


@dataclass(frozen=True, slots=True)
class RecordSchema:
    """The schema of a record's value: its fields in order.

    ``id`` identifies the schema where it came from (``registry:<id>``, ``connect:<hash>``):
    equal ids mean equal schemas, so a sink compares a schema with its target once per id, not
    once per record. ``key`` names the fields that make the record's key when the source says
    (a key schema, Debezium's key), for a target's primary key.
    """

    fields: tuple[Field, ...]
    id: str = ""
    name: str = ""
    key: tuple[str, ...] = ()
    _by_name: dict[str, Field] = field(default_factory=dict, compare=False, repr=False)
    _subs: dict[str, RecordSchema | None] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update((f.name, f) for f in self.fields)

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def get(self, name: str) -> Field | None:
        return self._by_name.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def sub(self, name: str) -> RecordSchema | None:
        """The schema of record field ``name`` (a Debezium envelope's ``after``), or None."""
        if name not in self._subs:
            f = self._by_name.get(name)
            self._subs[name] = (
                RecordSchema(f.type.fields, id=f"{self.id}/{name}", name=f"{self.name}.{name}")
                if f is not None and f.type.kind == "record"
                else None
            )
        return self._subs[name]


def widens(old: FieldType, new: FieldType) -> bool:
    """``new`` holds every value ``old`` holds (the same type, or a widening), so a target of
    type ``old`` may change to ``new`` and keep every stored value exactly."""
    if old.nullable and not new.nullable:
        return False
    if old.kind != new.kind:
        if (old.kind, new.kind) not in _WIDENINGS:
            return False
        if new.kind == "decimal":
            # An integer fits decimal(p, s) when p - s covers its digits.
            need = 10 if old.kind == "int32" else 19
            return _decimal_digits(new)[0] >= need
        return True
    if old.kind == "decimal":
        old_int, old_frac = _decimal_digits(old)
        new_int, new_frac = _decimal_digits(new)
        return new_frac >= old_frac and new_int >= old_int
    if old.kind in ("time", "timestamp", "timestamp_local"):
        return old.unit == new.unit or (old.unit, new.unit) == ("ms", "us")
    if old.kind == "enum":
        return set(old.symbols) <= set(new.symbols)
    if old.kind == "array":
        return old.items is None or (new.items is not None and widens(old.items, new.items))
    if old.kind == "map":
        return old.values is None or (new.values is not None and widens(old.values, new.values))
    if old.kind == "record":
        return all(
            (n := _field(new.fields, f.name)) is not None and widens(f.type, n.type)
            for f in old.fields
        ) and all(_field(old.fields, f.name) is not None or f.optional for f in new.fields)
    return True


def _decimal_digits(t: FieldType) -> tuple[float, float]:
    """Digits a decimal type holds before and after the point; unbounded (``inf``) where it
    sets no limit: no precision (an Avro ``bytes`` decimal without one, Debezium's
    ``VariableScaleDecimal``, a PostgreSQL ``numeric`` without a typmod) means any number of
    integer digits, and with no scale either, any number of fraction digits."""
    if t.precision is None:
        return math.inf, (math.inf if t.scale is None else t.scale)
    return t.precision - (t.scale or 0), (t.scale or 0)


def _required(t: FieldType) -> FieldType:
    return replace(t, nullable=False) if t.nullable else t


def _field(fields: tuple[Field, ...], name: str) -> Field | None:
    for f in fields:
        if f.name == name:
            return f
    return None


@dataclass(frozen=True, slots=True)
class Change:
    """One difference between a target's schema and a record's.

    ``kind``: ``add`` (a field the target lacks), ``widen`` (a field whose type the target must
    widen), ``relax`` (a field the record may leave null or out that the target requires:
    its column must take NULL). ``refused`` is None for a change a target may follow, else why
    it may not.
    """

    kind: str
    name: str
    old: FieldType | None
    new: FieldType | None
    refused: str | None = None


def compare(target: RecordSchema, record: RecordSchema) -> list[Change]:
    """What must change in ``target`` for it to hold records of ``record``'s schema.

    A change is allowed (``refused is None``) when no stored value changes: a field added (as a
    nullable column: existing rows have no value for it), a type widened (:func:`widens`), a
    required field made optional. A field of ``target`` that ``record`` lacks is no change when
    the target lets it be absent (nullable or defaulted), and refused when it does not (a
    required field dropped). A record type narrower than the target's (int32 values into an
    int64 target) needs no change: every value fits, which is what records written with an
    older schema need while newer ones flow beside them. Any other type change (a string
    field becoming int64, a float64 becoming int64) is refused.
    """
    out: list[Change] = []
    for f in record.fields:
        have = target.get(f.name)
        if have is None:
            out.append(Change("add", f.name, None, f.type))
            continue
        old, new = _required(have.type), _required(f.type)
        if old == new or widens(new, old):
            pass  # the same, or narrower in the record: the target's type holds every value
        elif widens(old, new):
            out.append(Change("widen", f.name, have.type, f.type))
        else:
            reason = (
                f"field {f.name!r}: {have.type.describe()} -> {f.type.describe()} is not a "
                "widening (stored values would change)"
            )
            out.append(Change("widen", f.name, have.type, f.type, refused=reason))
            continue
        if f.optional and not have.optional:
            out.append(Change("relax", f.name, have.type, f.type))
    for f in target.fields:
        if record.get(f.name) is None and not f.optional:
            out.append(
                Change(
                    "drop",
                    f.name,
                    f.type,
                    None,
                    refused=f"field {f.name!r} is required by the target and missing from "
                    "the record's schema",
                )
            )
    return out
