"""Configuration of a ``postgres`` sink (a ``sinks[]`` entry of a pipeline), and the limits
the prepared transactions' ids put on its name."""

from __future__ import annotations

import re
from typing import Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, SecretStr, ValidationInfo, field_validator

from twophase.participants.sdk import (
    SinkConfig,
    check_template,
    check_topic_replace,
    is_template,
)

__all__ = ["PostgresSinkConfig", "SINK_NAME_MAX"]

#: PostgreSQL's GIDSIZE is 200 bytes including the terminating NUL.
_GID_MAX_BYTES = 199


_GID_PREFIX = "twophase"


#: Longest part token: two 64-character names, a 12-digit txn number and two "~".
_TOKEN_MAX = 64 + 1 + 12 + 1 + 64


#: So that "twophase:{sink}:{token}" always fits in _GID_MAX_BYTES (9 + 40 + 1 + 142 = 192).
SINK_NAME_MAX = 40


_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


#: Column types in create_table are spliced into DDL: allow type syntax, never a statement.
_SQL_TYPE_PATTERN = r'^[A-Za-z_][A-Za-z0-9_ ,()\[\]".]*$'


class PostgresSinkConfig(SinkConfig):
    """Configuration of a ``postgres`` sink (``sinks[]`` entry of a pipeline)."""

    type: Literal["postgres"]
    #: Part of every prepared transaction's gid, hence short and without ":".
    name: str = Field(min_length=1, max_length=SINK_NAME_MAX, pattern=_NAME_PATTERN)
    #: libpq connection string or URI. Prefer ``password`` (or PGPASSWORD / .pgpass) over a
    #: password inside the DSN; either way neither is ever logged.
    dsn: str = Field(min_length=1, repr=False)
    #: Password of the DSN's user, kept out of the DSN (``${ENV:...}``, ``${FILE:...}``).
    password: SecretStr | None = None
    #: Target table, optionally ``schema.table``. Names are exact (case-sensitive), not folded.
    #: A template routes each record to a table of its own: ``${topic}`` is the record's topic
    #: (after ``topic_replace``), ``${value.FIELD}`` a field of the record, ``${source.FIELD}``
    #: a field of Debezium's ``source`` block, e.g. ``${source.table}`` (``docs/cdc.md``).
    table: str = Field(min_length=1)
    #: With a ``table`` template: ``[pattern, replacement]``, applied to the topic name with
    #: ``re.sub`` before it becomes ``${topic}`` (Kafka Connect's RegexRouter), e.g.
    #: ``['^inventory\.public\.', '']`` makes ``inventory.public.orders`` the table ``orders``.
    topic_replace: tuple[str, str] | None = None
    #: ``insert``: one row per record. ``upsert``: one row per ``key``, the latest record wins:
    #: a record whose key has no row inserts one, else it updates the columns whose fields it
    #: carries (an absent field leaves its column as it is: a partial update). ``update``: the
    #: same update, but a record whose key has no row changes nothing (update-only). Deletes
    #: apply in ``upsert`` and ``update`` (``docs/cdc.md``).
    mode: Literal["insert", "upsert", "update"] = "insert"
    #: Key of ``upsert`` and ``update``: target columns with a unique index or primary key on
    #: exactly these columns (``update`` needs only the columns). Empty: the table's primary
    #: key (each table's, with a ``table`` template).
    key: list[str] = Field(default_factory=list, validate_default=True)
    #: Target column -> JSON field (``a.b`` for nested). Default: every table column, fed from
    #: the same-named field. An absent field leaves the column to its DEFAULT on insert and
    #: untouched on update; an explicit JSON null stores NULL.
    columns: dict[str, str] | None = None
    #: Column -> SQL type: create the target table with these columns when it does not exist
    #: (with the upsert key as primary key: in ``upsert`` and ``update`` mode set ``key`` and
    #: declare its columns here, as every column ``columns`` maps). Without it the table must
    #: exist.
    create_table: dict[str, str] | None = None
    #: Create a missing table -- the fixed ``table``, or one a template names -- from the
    #: first record's schema (``docs/schema-changes.md``): a column per field, typed by the
    #: table in ``docs/types.md``, NOT NULL for a required field; in ``upsert`` and ``update``
    #: mode the schema's key (the record key's fields), else ``key``, is its primary key. Needs
    #: records that carry a schema (``value_format: connect_json``, a Debezium envelope with
    #: schemas): a record that must create its table and has none is dead-lettered with the
    #: reason. The table is created outside the part. Not with ``create_table`` or ``columns``.
    auto_create: bool = False
    #: Change a table when a record's schema needs a change the schema rule allows: a field
    #: added (a nullable column), a type widened (``integer`` to ``bigint``, ``real`` to
    #: ``double precision``, a ``numeric(p, s)`` grown), a required field made optional (DROP
    #: NOT NULL) -- inside the part's prepared transaction, so the change commits with the
    #: first rows that need it and is undone if the part aborts. Every record is compared with
    #: its table (once per table and schema): one without a schema, or whose schema needs a
    #: refused change (a required field dropped, a type narrowed or changed), is dead-lettered
    #: with the reason, as is any change while this is off but ``auto_create`` is on. The change
    #: holds ACCESS EXCLUSIVE on the table until the part is decided; the lock order that keeps
    #: participants from waiting on each other and its costs: ``docs/schema-changes.md``. Not
    #: with ``columns``.
    auto_evolve: bool = False
    #: Table of per-part markers, optionally ``schema.table``; created when missing. With
    #: ``auto_evolve``, the table of schema change requests, ``twophase_schema_changes``, is
    #: created beside it (in the same schema).
    marker_table: str = Field(default="twophase_parts", min_length=1)
    #: libpq's connect_timeout (whole seconds).
    connect_timeout_s: int = Field(default=10, ge=1, le=600)
    #: Session statement_timeout; None keeps the server's.
    statement_timeout_ms: int | None = Field(default=None, gt=0)
    #: Use the compiled JSON -> binary COPY encoder (``twophase-native``) when it is installed
    #: and the table allows it (insert mode, top-level fields, types it models). Same results
    #: either way; off only to compare or to rule it out.
    compiled_copy: bool = True

    @field_validator("auto_create", "auto_evolve")
    @classmethod
    def _schemas_map_fields_to_columns(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("columns") is not None:
            # A schema's fields become same-named columns; a mapping would leave a new field
            # without a column (ignored: a value dropped silently).
            raise ValueError("maps each field to its same-named column: remove columns")
        if value and info.field_name == "auto_create" and info.data.get("create_table"):
            raise ValueError("creates tables from record schemas: remove create_table")
        return value

    @field_validator("dsn")
    @classmethod
    def _dsn_parses(cls, value: str) -> str:
        try:
            conninfo_to_dict(value)
        except psycopg.ProgrammingError:
            # Not echoing the value: it may hold a password.
            raise ValueError("not a valid libpq connection string or URI") from None
        return value

    @property
    def templated(self) -> bool:
        """Whether ``table`` is a template (a table per topic or per field value)."""
        return is_template(self.table)

    @field_validator("table")
    @classmethod
    def _table_or_template(cls, value: str) -> str:
        if not is_template(value):
            return cls._qualified_name(value)
        return check_template(value)

    @field_validator("topic_replace")
    @classmethod
    def _replace_compiles(
        cls, value: tuple[str, str] | None, info: ValidationInfo
    ) -> tuple[str, str] | None:
        return check_topic_replace(value, info.data.get("table", ""))

    @field_validator("marker_table")
    @classmethod
    def _qualified_name(cls, value: str) -> str:
        parts = value.split(".")
        if len(parts) > 2 or not all(parts):
            raise ValueError(f"{value!r}: expected 'table' or 'schema.table'")
        return value

    @field_validator("key")
    @classmethod
    def _key_for_upsert(cls, value: list[str], info: ValidationInfo) -> list[str]:
        mode = info.data.get("mode")
        if mode == "insert" and value:
            raise ValueError("only used when mode is 'upsert' or 'update'")
        if len(set(value)) != len(value):
            raise ValueError("names a column twice")
        return value

    @field_validator("columns")
    @classmethod
    def _columns_cover_key(
        cls, value: dict[str, str] | None, info: ValidationInfo
    ) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must map at least one column (or be omitted)")
        missing = [k for k in info.data.get("key", []) if k not in value]
        if missing:
            raise ValueError(f"must map the upsert key column(s) {', '.join(missing)}")
        for column, path in value.items():
            if not path or any(not step for step in path.split(".")):
                raise ValueError(f"column {column!r}: {path!r} is not a field path")
        return value

    @field_validator("create_table")
    @classmethod
    def _create_table_types(
        cls, value: dict[str, str] | None, info: ValidationInfo
    ) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must declare at least one column")
        for column, sql_type in value.items():
            if not re.match(_SQL_TYPE_PATTERN, sql_type):
                raise ValueError(f"column {column!r}: {sql_type!r} is not a column type")
        # The table it makes must be one the sink can write: checked here, not at the first
        # record (a CREATE TABLE naming a key it lacks, a mapping to a column it has not).
        key = info.data.get("key") or []
        if info.data.get("mode") in ("upsert", "update") and not key:
            raise ValueError(
                "makes a table without a primary key, which upsert and update need: set key"
            )
        missing = [k for k in key if k not in value]
        if missing:
            raise ValueError(f"must declare the key column(s) {', '.join(missing)}")
        unmapped = [c for c in info.data.get("columns") or {} if c not in value]
        if unmapped:
            raise ValueError(f"declares no column {', '.join(unmapped)} that columns maps")
        return value
