"""The PostgreSQL sink's one table from schema field types to column types, and back
(participants/sinks/postgres/_schemas.py; docs/types.md, "Tables from record schemas")."""

from __future__ import annotations

from dataclasses import replace

import pytest
from psycopg import sql

from twophase.participants.sdk import Field, FieldType, RecordSchema, compare
from twophase.participants.sinks.postgres._schemas import (
    alter_table,
    column_type,
    create_table,
    describe,
    field_type,
    plan,
    table_schema,
)
from twophase.participants.sinks.postgres.types import Column


def t(kind: str, nullable: bool = False, **kw: object) -> FieldType:
    return FieldType(kind, nullable, **kw)  # type: ignore[arg-type]


def schema(*fields: Field, key: tuple[str, ...] = ()) -> RecordSchema:
    return RecordSchema(tuple(fields), key=key)


#: kind -> (column type as format_type spells it, pg_type.typname), every kind of the SDK.
TABLE = {
    "boolean": ("boolean", "bool"),
    "int32": ("integer", "int4"),
    "int64": ("bigint", "int8"),
    "float32": ("real", "float4"),
    "float64": ("double precision", "float8"),
    "string": ("text", "text"),
    "bytes": ("bytea", "bytea"),
    "uuid": ("uuid", "uuid"),
    "enum": ("text", "text"),
    "date": ("date", "date"),
    "time": ("time without time zone", "time"),
    "timestamp": ("timestamp with time zone", "timestamptz"),
    "timestamp_local": ("timestamp without time zone", "timestamp"),
    "array": ("jsonb", "jsonb"),
    "map": ("jsonb", "jsonb"),
    "record": ("jsonb", "jsonb"),
    "json": ("jsonb", "jsonb"),
}

TYPES = {
    "boolean": t("boolean"),
    "int32": t("int32"),
    "int64": t("int64"),
    "float32": t("float32"),
    "float64": t("float64"),
    "string": t("string"),
    "bytes": t("bytes"),
    "uuid": t("uuid"),
    "enum": t("enum", symbols=("a", "b")),
    "date": t("date"),
    "time": t("time", unit="ms"),
    "timestamp": t("timestamp", unit="us"),
    "timestamp_local": t("timestamp_local", unit="ms"),
    "array": t("array", items=t("int32")),
    "map": t("map", values=t("string")),
    "record": t("record", fields=(Field("x", t("int64")),)),
    "json": t("json"),
}


def col(
    name: str, sql_type: str, base: str, not_null: bool = False, default: bool = False
) -> Column:
    return Column(name, base, sql_type, not_null, default, None, True)


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_every_kind_has_its_column_type(kind: str) -> None:
    assert column_type(TYPES[kind]) == TABLE[kind][0]


@pytest.mark.parametrize(
    ("decimal", "expected"),
    [
        (t("decimal", precision=12, scale=2), "numeric(12,2)"),
        (t("decimal", precision=38, scale=0), "numeric(38,0)"),
        (t("decimal"), "numeric"),  # no precision: any number of digits
        (t("decimal", scale=3), "numeric"),  # a scale alone PostgreSQL cannot say
        (t("decimal", precision=1001, scale=2), "numeric"),  # beyond numeric's 1000 digits
        (t("decimal", precision=5, scale=7), "numeric"),  # scale above precision
    ],
)
def test_decimals_are_numeric_with_their_precision_when_postgresql_can_keep_it(
    decimal: FieldType, expected: str
) -> None:
    assert column_type(decimal) == expected


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_a_column_made_for_a_type_reads_back_as_needing_no_change(kind: str) -> None:
    """What auto_create makes, compare() finds equal to the schema it was made from."""
    sql_type, base = TABLE[kind]
    record = schema(Field("v", TYPES[kind]), Field("n", replace(TYPES[kind], nullable=True)))
    columns = [col("v", sql_type, base, not_null=True), col("n", sql_type, base)]
    assert compare(table_schema(columns, record), record) == []


def test_reverse_mapping_of_the_scalar_column_types() -> None:
    assert field_type(col("a", "integer", "int4", not_null=True)) == t("int32")
    assert field_type(col("a", "smallint", "int2")) == t("int32", True)
    assert field_type(col("a", "bigint", "int8")) == t("int64", True)
    assert field_type(col("a", "numeric(12,2)", "numeric")) == t(
        "decimal", True, precision=12, scale=2
    )
    assert field_type(col("a", "numeric", "numeric")) == t("decimal", True)
    assert field_type(col("a", "character varying(20)", "varchar")) == t("string", True)
    assert field_type(col("a", "timestamp with time zone", "timestamptz")) == t(
        "timestamp", True, unit="us"
    )
    assert field_type(col("a", "timestamp without time zone", "timestamp")) == t(
        "timestamp_local", True, unit="us"
    )
    # Types that hold whatever the record brings: never changed by a schema.
    for sql_type, base in [
        ("jsonb", "jsonb"),
        ("json", "json"),
        ("inet", "inet"),
        ("mood", "enum"),
    ]:
        assert field_type(col("a", sql_type, base)) is None


def test_a_jsonb_or_unmodelled_column_takes_any_field_type() -> None:
    columns = [col("doc", "jsonb", "jsonb"), col("ip", "inet", "inet")]
    record = schema(Field("doc", t("string")), Field("ip", t("string")))
    assert compare(table_schema(columns, record), record) == []


def test_widenings_become_one_alter_table() -> None:
    now = {
        "id": col("id", "bigint", "int8", not_null=True),
        "n": col("n", "integer", "int4"),
        "f": col("f", "real", "float4"),
        "amount": col("amount", "numeric(10,2)", "numeric"),
        "name": col("name", "text", "text", not_null=True),
    }
    newer = schema(
        Field("id", t("int64")),
        Field("n", t("int64", True)),
        Field("f", t("float64", True)),
        Field("amount", t("decimal", True, precision=14, scale=2)),
        Field("name", t("string", True)),
        Field("note", t("string")),  # required in the record: nullable in the table all the same
    )
    got = plan(now, [newer], key=["id"])
    assert got.refused == {}
    ddl = alter_table(sql.Identifier("t"), now, got.columns)
    assert ddl is not None
    assert ddl.as_string(None) == (
        'ALTER TABLE "t" ALTER COLUMN "n" TYPE bigint USING "n"::bigint, '
        'ALTER COLUMN "f" TYPE double precision USING "f"::double precision, '
        'ALTER COLUMN "amount" TYPE numeric(14,2) USING "amount"::numeric(14,2), '
        'ALTER COLUMN "name" DROP NOT NULL, ADD COLUMN "note" text'
    )
    assert describe(now, got.columns) == (
        "column 'n' from integer to bigint, column 'f' from real to double precision, "
        "column 'amount' from numeric(10,2) to numeric(14,2), column 'name' nullable, "
        "column 'note' added (text)"
    )
    # The columns it plans read back as needing nothing more.
    assert plan(got.columns, [newer], key=["id"]).columns == got.columns


def test_no_change_is_no_statement_and_older_records_fit_a_widened_table() -> None:
    now = {"id": col("id", "bigint", "int8", not_null=True)}
    older = schema(Field("id", t("int32")))
    got = plan(now, [older])
    assert got.columns == now and got.refused == {}
    assert alter_table(sql.Identifier("t"), now, got.columns) is None


def test_schemas_fold_in_order_and_a_refused_one_changes_nothing() -> None:
    now = {"id": col("id", "bigint", "int8", not_null=True), "x": col("x", "integer", "int4")}
    adds = schema(
        Field("id", t("int64")), Field("x", t("int32", True)), Field("y", t("int32", True))
    )
    widens = schema(
        Field("id", t("int64")), Field("x", t("int32", True)), Field("y", t("int64", True))
    )
    retyped = schema(Field("id", t("int64")), Field("x", t("string", True)))
    dropped = schema(Field("x", t("int32", True)))  # the required id is gone
    got = plan(now, [adds, widens, retyped, dropped], key=["id"])
    assert got.columns["y"].sql_type == "bigint"  # added, then widened: added as bigint
    assert got.columns["x"].sql_type == "integer"
    assert set(got.refused) == {2, 3}
    assert got.refused[2] == (
        "field 'x': int32? -> string? is not a widening (stored values would change)"
    )
    assert "'id' is required by the target" in got.refused[3]
    ddl = alter_table(sql.Identifier("t"), now, got.columns)
    assert ddl is not None and ddl.as_string(None) == 'ALTER TABLE "t" ADD COLUMN "y" bigint'


def test_the_table_refuses_what_it_cannot_follow() -> None:
    now = {"id": col("id", "bigint", "int8", not_null=True)}
    too_long = "x" * 64
    got = plan(
        now, [schema(Field("id", t("int64", True)), Field(too_long, t("int32", True)))], ["id"]
    )
    assert got.columns == now
    assert "its column is in the table's key" in got.refused[0]
    assert "1 to 63 bytes" in got.refused[0]


def test_create_table_keys_and_not_null() -> None:
    record = schema(
        Field("id", t("int32")),
        Field("name", t("string", True)),
        Field("qty", t("int32"), has_default=True),
        Field("amount", t("decimal", precision=12, scale=2)),
        key=("id",),
    )
    ddl = create_table(sql.Identifier("orders"), record, ["id"])
    assert ddl.as_string(None) == (
        'CREATE TABLE IF NOT EXISTS "orders" ("id" integer NOT NULL, "name" text, '
        '"qty" integer, "amount" numeric(12,2) NOT NULL, PRIMARY KEY ("id"))'
    )
    keyless = create_table(sql.Identifier("log"), record, [])
    assert "PRIMARY KEY" not in keyless.as_string(None)
