"""The iceberg sink's configuration: the ``sinks[]`` entry of ``type: iceberg``."""

from __future__ import annotations

import re
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from twophase.participants.sdk import SinkConfig

__all__ = [
    "PARTITION_PATTERN",
    "TYPE_PATTERN",
    "CatalogConfig",
    "IcebergSinkConfig",
    "MaintenanceConfig",
]

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
#: ``col`` or ``identity(col)``, ``year|month|day|hour(col)``, ``bucket(n, col)``,
#: ``truncate(width, col)``.
PARTITION_PATTERN = re.compile(
    r"\s*(?:(?P<fn>identity|year|month|day|hour|bucket|truncate)\s*\(\s*"
    r"(?:(?P<n>[0-9]+)\s*,\s*)?(?P<col>[A-Za-z_][A-Za-z0-9_]*)\s*\)"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))\s*"
)
#: The column types ``create_table`` takes: Iceberg's primitive type names.
TYPE_PATTERN = re.compile(
    r"boolean|int|long|float|double|date|time|timestamp|timestamptz|string|uuid|binary"
    r"|decimal\(\s*[0-9]+\s*,\s*[0-9]+\s*\)"
)


class CatalogConfig(BaseModel):
    """Where the tables are: pyiceberg's SQL catalog in a PostgreSQL database, and a warehouse."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    #: PostgreSQL URI of the catalog's database (``postgresql://user@host:5432/db``). The sink
    #: keeps its part markers in the same database, so that a commit swaps the table's metadata
    #: pointer and marks the part committed in one transaction.
    uri: str = Field(min_length=1, repr=False)
    #: Password of the URI's user, kept out of the URI (``${ENV:...}``, ``${FILE:...}``).
    password: SecretStr | None = None
    #: The catalog's name (pyiceberg's ``catalog_name`` column): tables of one name in two
    #: catalogs of one database are two tables.
    name: str = Field(default="twophase", min_length=1)
    #: PostgreSQL schema of the catalog's tables (``iceberg_tables``,
    #: ``iceberg_namespace_properties``) and the sink's (``twophase_iceberg_parts``,
    #: ``twophase_iceberg_positions``); made when missing.
    schema_: str = Field(default="iceberg_catalog", alias="schema", pattern=r"^[a-z_][a-z0-9_]*$")
    #: Where new tables put their files: ``file:///path`` (or a plain absolute path) on one
    #: local file system, or ``s3://bucket/prefix`` with the ``s3.*`` properties below.
    warehouse: str = Field(min_length=1)
    #: pyiceberg catalog / FileIO properties, e.g. ``s3.endpoint``, ``s3.access-key-id``,
    #: ``s3.secret-access-key`` and ``s3.region`` (required with ``s3.endpoint``).
    properties: dict[str, str] = Field(default_factory=dict)

    @field_validator("uri")
    @classmethod
    def _postgres_uri(cls, value: str) -> str:
        if not re.match(r"^postgres(ql)?://", value):
            raise ValueError(
                "must be a postgresql:// URI (the sink keeps its markers beside the catalog, "
                "in the same PostgreSQL database)"
            )
        return value

    @field_validator("properties")
    @classmethod
    def _region(cls, value: dict[str, str]) -> dict[str, str]:
        if "s3.endpoint" in value and not value.get("s3.region"):
            # Without it pyiceberg asks AWS where the bucket is: seconds per connection, then a
            # failure -- or another party's bucket of the same name, on a machine that can ask.
            raise ValueError("s3.region is required with s3.endpoint (MinIO: us-east-1)")
        return value

    @field_validator("warehouse")
    @classmethod
    def _warehouse(cls, value: str) -> str:
        if value.startswith("/"):
            return f"file://{value}"
        if not re.match(r"^(file|s3|s3a)://", value):
            raise ValueError("must be file:///path, an absolute path, or s3://bucket/prefix")
        return value


class MaintenanceConfig(BaseModel):
    """What ``twophase sinks maintain`` does to the sink's table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Rewrite a partition that has at least this many files smaller than half the table's
    #: ``write.target-file-size-bytes`` into as few as the target allows; 0: no compaction.
    compact_min_files: int = Field(default=8, ge=0)
    #: Expire snapshots older than this many seconds ...
    expire_after_s: float = Field(default=3600.0, ge=0)
    #: ... but always keep this many of the newest (and every branch or tag head).
    keep_snapshots: int = Field(default=10, ge=1)
    #: Delete a file no remaining snapshot and no prepared part references only when it is
    #: older than this: a reader that planned a scan before its snapshot was expired keeps its
    #: files that long, and so does a commit or prepare in flight, which writes its files
    #: before anything references them (hence at least 10 minutes).
    orphan_grace_s: float = Field(default=3600.0, ge=600)


class IcebergSinkConfig(SinkConfig):
    """``sinks[]`` entry of ``type: iceberg``."""

    type: Literal["iceberg"]
    name: str = Field(min_length=1, max_length=64, pattern=_NAME_PATTERN)
    #: The SQL catalog (a PostgreSQL database) and the warehouse: the rows below.
    catalog: CatalogConfig
    #: ``namespace.table`` (the namespace may have dots: ``a.b.table``); made when missing.
    table: str = Field(pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+$")
    #: ``append``: every record is a new row. ``upsert``: one row per ``key``, the part's last
    #: change of a key wins, deletes apply; the commit rewrites the data files holding the
    #: part's keys (copy-on-write: ``docs/iceberg.md`` has the cost).
    mode: Literal["append", "upsert"] = "append"
    #: The columns that identify a row in ``upsert`` mode.
    key: list[str] = Field(default_factory=list)
    #: Column -> Iceberg type (``long``, ``string``, ``decimal(12, 2)``, ``timestamptz``, ...):
    #: create the table with these columns when it does not exist (key columns required).
    #: Without it the table must exist.
    create_table: dict[str, str] | None = None
    #: Partition spec of a table the sink creates: ``col`` / ``identity(col)``,
    #: ``year|month|day|hour(col)``, ``bucket(n, col)``, ``truncate(width, col)``.
    partition_by: list[str] = Field(default_factory=list)
    #: A record field that is not a column: ``reject`` the record (dead-lettered with the
    #: field named) or ``drop`` the field.
    unknown_fields: Literal["reject", "drop"] = "reject"
    #: Records with a schema (a registry format, a Kafka Connect envelope, Debezium): a record
    #: whose schema adds a field, widens a type Iceberg can promote (int to long, float to
    #: double, a decimal's precision) or makes a field optional changes the table first, in a
    #: commit of its own (``docs/iceberg.md``, "Schema changes"). False: such records are
    #: refused when they carry a field that is no column (``unknown_fields``). Incompatible
    #: changes are refused either way, with the reason.
    auto_evolve: bool = False
    #: Compaction, snapshot expiry and file removal by ``twophase sinks maintain``
    #: (``docs/iceberg.md``, "Maintenance").
    maintenance: MaintenanceConfig = Field(default_factory=MaintenanceConfig)

    @field_validator("partition_by")
    @classmethod
    def _partitions(cls, value: list[str]) -> list[str]:
        for item in value:
            m = PARTITION_PATTERN.fullmatch(item)
            if (
                m
                and m.group("fn")
                and (m.group("fn") in ("bucket", "truncate")) != bool(m.group("n"))
            ):
                m = None  # bucket and truncate take a number; the others none
            if not m:
                raise ValueError(
                    f"{item!r}: expected col, identity(col), year|month|day|hour(col), "
                    "bucket(n, col) or truncate(width, col)"
                )
        return value

    @field_validator("create_table")
    @classmethod
    def _types(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if not value:
                raise ValueError("name at least one column")
            for column, kind in value.items():
                if not TYPE_PATTERN.fullmatch(kind.strip().lower()):
                    raise ValueError(f"column {column!r}: {kind!r} is not an Iceberg type")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.mode == "upsert" and not self.key:
            raise ValueError("key: upsert mode needs the columns that identify a row")
        if self.mode == "append" and self.key:
            raise ValueError("key: only upsert mode uses a key")
        if self.create_table is not None:
            for column in self.key:
                if column not in self.create_table:
                    raise ValueError(f"key: {column!r} is not a column of create_table")
            for item in self.partition_by:
                m = PARTITION_PATTERN.fullmatch(item)
                assert m is not None
                column = m.group("col") or m.group("bare")
                if column not in self.create_table:
                    raise ValueError(f"partition_by: {column!r} is not a column of create_table")
        elif self.partition_by:
            raise ValueError("partition_by: applies to a table the sink creates (create_table)")
        return self

    @property
    def namespace(self) -> str:
        return self.table.rsplit(".", 1)[0]
