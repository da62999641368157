"""The conformance kit against the three built-in sinks, on the real stores of the local stack.

Each class supplies the kit's ``twophase_sink_factory`` for one sink: a target of its own per
test, and a reader that looks at the store as a dataset reader would, with no sink code.
``known_failures`` lists kit cases a sink fails because of a bug in the sink, by name; the plugin
runs them as strict xfails, so a fix shows up as XPASS and the entry must go.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import psycopg
import pyarrow.parquet as pq
import pytest
from pymongo import MongoClient

from twophase.participants.sdk.testkit import DeleteConformance, SinkConformance, SinkFactory
from twophase.participants.sinks.files import FileSink
from twophase.participants.sinks.mongodb import MongoSink
from twophase.participants.sinks.postgres import PostgresSink

#: The kit's record values are {"id": str, "n": int, "text": str}; a refused one per store.
NEGATIVE_N = {"id": "refused", "n": -1, "text": "a CHECK constraint refuses a negative n"}


# -- PostgreSQL ---------------------------------------------------------------------------------


@pytest.mark.stack
class TestPostgresSink(SinkConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str) -> Iterator[SinkFactory]:
        name = f"kit{uuid.uuid4().hex[:10]}"
        table, markers = f"{name}_rows", f"{name}_parts"
        reader = psycopg.connect(pg_dsn, autocommit=True)
        reader.execute(
            f'CREATE TABLE "{table}" (id text NOT NULL, n bigint CHECK (n >= 0), text text)'
        )

        def committed_ids() -> list[str]:
            return [row[0] for row in reader.execute(f'SELECT id FROM "{table}"')]

        try:
            yield SinkFactory(
                sink_class=PostgresSink,
                config={
                    "name": name,
                    "type": "postgres",
                    "dsn": pg_dsn,
                    "table": table,
                    "marker_table": markers,
                },
                committed_ids=committed_ids,
                bad_value=NEGATIVE_N,  # refused by the server: exercises the sink's bisection
            )
        finally:
            # The kit aborts what it left; this catches a kit that could not (a broken sink).
            for (gid,) in reader.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)",
                (f"twophase:{name}:",),
            ).fetchall():
                reader.execute(f"ROLLBACK PREPARED '{gid}'")
            reader.execute(f'DROP TABLE IF EXISTS "{table}", "{markers}"')
            reader.close()


# -- MongoDB (SecantusDB in the local stack) -----------------------------------------------------


@pytest.mark.stack
class TestMongoSink(SinkConformance):
    @pytest.fixture
    def twophase_sink_factory(self, mongo_uri: str) -> Iterator[SinkFactory]:
        database = f"kit_{uuid.uuid4().hex[:12]}"
        client: MongoClient[dict[str, object]] = MongoClient(mongo_uri)

        def committed_ids() -> list[str]:
            return [str(d["id"]) for d in client[database]["target"].find({}, {"id": 1})]

        try:
            yield SinkFactory(
                sink_class=MongoSink,
                config={
                    "name": "mongokit",
                    "type": "mongodb",
                    "uri": mongo_uri,
                    "database": database,
                    "collection": "target",
                },
                committed_ids=committed_ids,
                bad_value={"id": "refused", "$n": 1, "text": "a field name MongoDB refuses"},
                # SecantusDB does thousands of writes a second, not tens of thousands.
                large_batch=2_000,
            )
        finally:
            client.drop_database(database)
            client.close()


# -- files ------------------------------------------------------------------------------------


def _visible_files(base: Path) -> list[Path]:
    """What a dataset reader lists: no path component starting with ``_`` or ``.``."""
    return sorted(
        p
        for p in base.rglob("*")
        if p.is_file() and not any(c.startswith(("_", ".")) for c in p.relative_to(base).parts)
    )


def _file_factory(base: Path, fmt: str) -> SinkFactory:
    def committed_ids() -> list[str]:
        found: list[str] = []
        for path in _visible_files(base):
            if fmt == "parquet":
                found.extend(pq.read_table(path, columns=["id"]).column("id").to_pylist())
            else:
                found.extend(json.loads(line)["id"] for line in path.read_text().splitlines())
        return found

    return SinkFactory(
        sink_class=FileSink,
        config={
            "name": "files",
            "type": "files",
            "path": str(base),
            "format": fmt,
            "schema": {"id": "string", "n": "int64", "text": "string"},
        },
        committed_ids=committed_ids,
        bad_value={"id": "refused", "n": "not a number", "text": "the schema refuses it"},
    )


FILES_KNOWN_FAILURES: dict[str, str] = {}


class TestFileSinkParquet(SinkConformance):
    known_failures: ClassVar[Mapping[str, str]] = FILES_KNOWN_FAILURES

    @pytest.fixture
    def twophase_sink_factory(self, tmp_path: Path) -> SinkFactory:
        return _file_factory(tmp_path / "dataset", "parquet")


class TestFileSinkJsonLines(SinkConformance):
    known_failures: ClassVar[Mapping[str, str]] = FILES_KNOWN_FAILURES

    @pytest.fixture
    def twophase_sink_factory(self, tmp_path: Path) -> SinkFactory:
        return _file_factory(tmp_path / "dataset", "jsonl")


# -- deletes (docs/cdc.md): each sink configured to apply them, keyed on the value's id ----------


@pytest.mark.stack
class TestPostgresSinkDeletes(DeleteConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str) -> Iterator[SinkFactory]:
        name = f"kit{uuid.uuid4().hex[:10]}"
        table, markers = f"{name}_rows", f"{name}_parts"
        reader = psycopg.connect(pg_dsn, autocommit=True)
        reader.execute(f'CREATE TABLE "{table}" (id text PRIMARY KEY, n bigint, text text)')
        try:
            yield SinkFactory(
                sink_class=PostgresSink,
                config={
                    "name": name,
                    "type": "postgres",
                    "dsn": pg_dsn,
                    "table": table,
                    "marker_table": markers,
                    "mode": "upsert",
                    "key": ["id"],
                },
                committed_ids=lambda: [r[0] for r in reader.execute(f'SELECT id FROM "{table}"')],
            )
        finally:
            for (gid,) in reader.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)",
                (f"twophase:{name}:",),
            ).fetchall():
                reader.execute(f"ROLLBACK PREPARED '{gid}'")
            reader.execute(f'DROP TABLE IF EXISTS "{table}", "{markers}"')
            reader.close()


@pytest.mark.stack
class TestMongoSinkDeletes(DeleteConformance):
    @pytest.fixture
    def twophase_sink_factory(self, mongo_uri: str) -> Iterator[SinkFactory]:
        database = f"kit_{uuid.uuid4().hex[:12]}"
        client: MongoClient[dict[str, object]] = MongoClient(mongo_uri)
        try:
            yield SinkFactory(
                sink_class=MongoSink,
                config={
                    "name": "mongokit",
                    "type": "mongodb",
                    "uri": mongo_uri,
                    "database": database,
                    "collection": "target",
                    "mode": "upsert",
                    "key": ["id"],
                },
                committed_ids=lambda: [
                    str(d["_id"]) for d in client[database]["target"].find({}, {"_id": 1})
                ],
            )
        finally:
            client.drop_database(database)
            client.close()


class TestFileSinkDeletes(DeleteConformance):
    """Change rows: what a reader gets by replaying them in (partition, offset) order."""

    @pytest.fixture
    def twophase_sink_factory(self, tmp_path: Path) -> SinkFactory:
        base = tmp_path / "dataset"

        def current_ids() -> list[str]:
            rows: list[dict[str, object]] = []
            for path in _visible_files(base):
                rows.extend(json.loads(line) for line in path.read_text().splitlines())
            state: set[str] = set()
            for row in sorted(rows, key=lambda r: (str(r["_partition"]), int(str(r["_offset"])))):
                if row["_op"] == "d":
                    state.discard(str(row["id"]))
                else:
                    state.add(str(row["id"]))
            return sorted(state)

        return SinkFactory(
            sink_class=FileSink,
            config={
                "name": "files",
                "type": "files",
                "path": str(base),
                "format": "jsonl",
                "op_column": "_op",
                "source_columns": True,
            },
            committed_ids=current_ids,
        )


# -- Iceberg (pyiceberg's SQL catalog in the stack's PostgreSQL, a local warehouse) -------------


def _iceberg_factory(pg_dsn: str, warehouse: Path, mode: str) -> Iterator[SinkFactory]:
    """A table of its own per test (its own catalog name), read by a pyiceberg scan."""
    from pyiceberg.catalog.sql import SqlCatalog

    from harness import iceberg_catalog
    from twophase.participants.sinks.iceberg import IcebergSink

    catalog = f"kit{uuid.uuid4().hex[:10]}"
    table = "kit.rows"
    config: dict[str, object] = {
        "name": "lake",
        "type": "iceberg",
        "catalog": {"uri": pg_dsn, "name": catalog, "warehouse": str(warehouse)},
        "table": table,
        "create_table": {"id": "string", "n": "long", "text": "string"},
    }
    if mode == "upsert":
        config.update(mode="upsert", key=["id"])
    reader: list[SqlCatalog] = []

    def committed_ids() -> list[str]:
        if not reader:
            reader.append(iceberg_catalog(pg_dsn, catalog, warehouse))
        scan = reader[0].load_table(table).scan(selected_fields=("id",))
        return [str(v) for v in scan.to_arrow().column("id").to_pylist()]

    try:
        yield SinkFactory(
            sink_class=IcebergSink,
            config=config,
            committed_ids=committed_ids,
            # "n" is a long column: a string that spells no integer is refused.
            bad_value={
                "id": "refused",
                "n": "not a number",
                "text": "the column's type refuses it",
            },
        )
    finally:
        for r in reader:
            r.engine.dispose()


@pytest.mark.stack
class TestIcebergSink(SinkConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str, tmp_path: Path) -> Iterator[SinkFactory]:
        yield from _iceberg_factory(pg_dsn, tmp_path / "warehouse", "append")


@pytest.mark.stack
class TestIcebergSinkDeletes(DeleteConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str, tmp_path: Path) -> Iterator[SinkFactory]:
        yield from _iceberg_factory(pg_dsn, tmp_path / "warehouse", "upsert")
