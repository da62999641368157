"""The one rule for schema changes (participants/sdk/schema.py): which a target may follow."""

from __future__ import annotations

import pytest

from twophase.participants.sdk import Field, FieldType, RecordSchema, compare
from twophase.participants.sdk.schema import widens


def t(kind: str, nullable: bool = False, **kw: object) -> FieldType:
    return FieldType(kind, nullable, **kw)  # type: ignore[arg-type]


def schema(*fields: tuple[str, FieldType] | tuple[str, FieldType, bool]) -> RecordSchema:
    return RecordSchema(tuple(Field(*f) for f in fields))


BASE = schema(("id", t("int64")), ("name", t("string")), ("amount", t("float32", True)))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (t("int32"), t("int64")),
        (t("int32"), t("float64")),
        (t("float32"), t("float64")),
        (t("int64"), t("decimal", precision=19, scale=0)),
        (t("int32"), t("decimal", precision=12, scale=2)),
        (t("decimal", precision=10, scale=2), t("decimal", precision=12, scale=4)),
        (t("timestamp", unit="ms"), t("timestamp", unit="us")),
        (t("enum", symbols=("a",)), t("enum", symbols=("a", "b"))),
        (t("enum", symbols=("a",)), t("string")),
        (t("array", items=t("int32")), t("array", items=t("int64"))),
        (t("int32"), t("int32", True)),
        # No precision and no scale: any decimal (a numeric without typmod, VariableScale).
        (t("decimal", precision=38, scale=10), t("decimal")),
        (t("int64"), t("decimal")),
        (t("decimal", precision=10, scale=2), t("decimal", scale=2)),
    ],
)
def test_widenings_keep_every_value(old: FieldType, new: FieldType) -> None:
    assert widens(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (t("int64"), t("int32")),
        (t("int64"), t("float64")),  # 2**53 + 1 has no double
        (t("float64"), t("int64")),
        (t("string"), t("int64")),
        (t("int64"), t("decimal", precision=18, scale=0)),
        (t("decimal", precision=10, scale=2), t("decimal", precision=10, scale=3)),
        (t("timestamp", unit="us"), t("timestamp", unit="ms")),
        (t("enum", symbols=("a", "b")), t("enum", symbols=("a",))),
        (t("int32", True), t("int32")),
        (t("timestamp", unit="ms"), t("timestamp_local", unit="ms")),
        (t("decimal"), t("decimal", precision=38, scale=10)),
        (t("decimal", scale=2), t("decimal", precision=38, scale=2)),
        (t("decimal", precision=10, scale=3), t("decimal", scale=2)),
    ],
)
def test_narrowings_and_other_changes_do_not_widen(old: FieldType, new: FieldType) -> None:
    assert not widens(old, new)


def test_the_same_schema_needs_no_change() -> None:
    assert compare(BASE, BASE) == []


def test_an_optional_field_added_and_a_type_widened_are_followed() -> None:
    newer = schema(
        ("id", t("int64")),
        ("name", t("string")),
        ("amount", t("float64", True)),
        ("note", t("string", True)),
    )
    changes = compare(BASE, newer)
    assert [(c.kind, c.name, c.refused) for c in changes] == [
        ("widen", "amount", None),
        ("add", "note", None),
    ]


def test_a_required_field_dropped_is_refused_and_an_optional_one_is_not() -> None:
    changes = compare(BASE, schema(("id", t("int64")), ("amount", t("float32", True))))
    assert [(c.kind, c.name) for c in changes] == [("drop", "name")]
    assert "required" in (changes[0].refused or "")
    assert compare(BASE, schema(("id", t("int64")), ("name", t("string")))) == []


def test_a_narrower_record_type_fits_its_target_and_needs_no_change() -> None:
    # Records written with an older schema keep flowing beside newer ones during an evolution.
    assert compare(BASE, schema(("id", t("int32")), ("name", t("string")))) == []


def test_a_type_changed_beyond_widening_is_refused_naming_field_and_types() -> None:
    changes = compare(BASE, schema(("id", t("string")), ("name", t("string"))))
    assert [(c.kind, c.name) for c in changes] == [("widen", "id")]
    assert changes[0].refused == (
        "field 'id': int64 -> string is not a widening (stored values would change)"
    )


def test_a_field_the_record_may_leave_null_relaxes_a_required_target_field() -> None:
    changes = compare(BASE, schema(("id", t("int64")), ("name", t("string", True))))
    assert [(c.kind, c.name, c.refused) for c in changes] == [("relax", "name", None)]
    defaulted = compare(BASE, schema(("id", t("int64")), ("name", t("string"), True)))
    assert [(c.kind, c.name) for c in defaulted] == [("relax", "name")]


def test_a_constrained_decimal_fits_an_unconstrained_target_and_needs_no_change() -> None:
    # Not the widening numeric -> numeric(10,2) a missing precision read as 0 made of it.
    target = schema(("amount", t("decimal")))
    assert compare(target, schema(("amount", t("decimal", precision=10, scale=2)))) == []
    changes = compare(schema(("amount", t("decimal", precision=10, scale=2))), target)
    assert [(c.kind, c.refused) for c in changes] == [("widen", None)]
