"""The iceberg sink's store operations (:class:`IcebergSink`); the package docstring tells the
story."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import warnings
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import psycopg
import pyarrow as pa
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NoSuchTableError,
    TableAlreadyExistsError,
    ValidationException,
)
from pyiceberg.expressions import And, BooleanExpression, EqualTo, In, Or
from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible, _dataframe_to_data_files
from pyiceberg.manifest import (
    DataFile,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
    write_manifest,
)
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import (
    BucketTransform,
    DayTransform,
    HourTransform,
    IdentityTransform,
    MonthTransform,
    Transform,
    TruncateTransform,
    YearTransform,
)
from pyiceberg.types import (
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    NestedField,
    PrimitiveType,
    StringType,
    TimestampType,
    TimestamptzType,
)

from twophase.participants import sdk
from twophase.participants.sdk import (
    AbortTransactionError,
    FatalSinkError,
    OpenSlot,
    PartId,
    PartMarker,
    PartState,
    RawBatch,
    Record,
    Rejected,
    RetriableSinkError,
    fsync_dir,
    positions_from_json,
    positions_to_json,
)
from twophase.participants.sinks.iceberg import _evolve
from twophase.participants.sinks.iceberg._catalog import PartCatalog, connect, open_catalog
from twophase.participants.sinks.iceberg._maintain import locked_table, maintain
from twophase.participants.sinks.iceberg._parts import Parts
from twophase.participants.sinks.iceberg._rows import PartRows, RawReader, RowMaker
from twophase.participants.sinks.iceberg._types import BY_NAME
from twophase.participants.sinks.iceberg.config import PARTITION_PATTERN, IcebergSinkConfig

__all__ = ["IcebergSink", "TABLE_PROPERTIES"]

#: Properties of a table the sink creates: manifests merged as they pile up (scan planning
#: stays fast at one commit a second), old metadata files deleted after a commit.
TABLE_PROPERTIES = {
    "commit.manifest-merge.enabled": "true",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "100",
}
#: Snapshot summary keys of a part's commit.
PART_KEY = "twophase.part"
SINK_KEY = "twophase.sink"
_TRANSFORMS: dict[str, Any] = {
    "identity": lambda n: IdentityTransform(),
    "year": lambda n: YearTransform(),
    "month": lambda n: MonthTransform(),
    "day": lambda n: DayTransform(),
    "hour": lambda n: HourTransform(),
    "bucket": lambda n: BucketTransform(int(n)),
    "truncate": lambda n: TruncateTransform(int(n)),
}
_STORE_ERRORS = (psycopg.Error, OSError)
#: Key column types: those whose values a delete's filter compares exactly.
_KEY_TYPES = (
    IntegerType,
    LongType,
    StringType,
    DateType,
    TimestampType,
    TimestamptzType,
    DecimalType,
)
#: The most keys one ``In`` of a delete holds; more are OR-ed in chunks.
_IN_CHUNK = 10_000


class IcebergSink(sdk.BatchingSink):
    """Exactly-once into an Apache Iceberg table: a part's data files are written at prepare,
    appended in one snapshot at commit, in the same PostgreSQL transaction that marks it
    committed."""

    config_model: ClassVar[type[sdk.SinkConfig]] = IcebergSinkConfig

    def __init__(self, config: sdk.SinkConfig, context: sdk.SinkContext) -> None:
        assert isinstance(config, IcebergSinkConfig)
        super().__init__(config, context)
        self.cfg = config
        self._parts = Parts(config.catalog.schema_, config.name)
        self._catalog: PartCatalog | None = None
        self._maker: RowMaker | None = None
        self._raw: RawReader | None = None
        self._schema_id = -1
        #: auto_evolve: (record schema id, table schema id) -> None (fits) or why not.
        self._fits: dict[tuple[str, int], str | None] = {}
        self._slot: OpenSlot[PartRows] = OpenSlot()
        # One connection per thread: the data thread's prepare, the control thread's commit.
        self._local = threading.local()
        self._conns: list[psycopg.Connection[Any]] = []
        self._conns_lock = threading.Lock()

    @property
    def supports_deletes(self) -> bool:
        return self.cfg.mode == "upsert"

    def accepts_raw(self) -> bool:
        """Append mode into a table whose columns Arrow's JSON reader converts by the same
        rules (:class:`~._rows.RawReader`): values are read into Arrow without decoding."""
        return self.cfg.mode == "append" and self._raw is not None and self._raw.usable

    # -- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        try:
            self._catalog = open_catalog(self.cfg.catalog)
            with self._conn() as conn:
                self._parts.create(conn)
            table = self._load_or_create(self._catalog)
        except (psycopg.OperationalError, OSError) as exc:
            raise RetriableSinkError(f"setup: {exc}", sink=self.name) from exc
        except (psycopg.Error, ValueError) as exc:
            raise FatalSinkError(f"setup: {exc}", sink=self.name) from exc
        schema = table.schema()
        names = {f.name for f in schema.fields}
        missing = [k for k in self.cfg.key if k not in names]
        if missing:
            raise FatalSinkError(
                f"key: {missing} are not columns of {self.cfg.table} ({sorted(names)})",
                sink=self.name,
            )
        odd = [
            f.name
            for f in schema.fields
            if f.name in self.cfg.key and not isinstance(f.field_type, _KEY_TYPES)
        ]
        if odd:
            raise FatalSinkError(
                f"key: {odd} must be int, long, string, date, timestamp(tz) or decimal columns",
                sink=self.name,
            )
        self._use_schema(schema)
        self.log.info(
            "iceberg sink %s: table %s (%d columns, spec %s), mode %s",
            self.name,
            self.cfg.table,
            len(schema.fields),
            table.spec(),
            self.cfg.mode,
        )

    def _use_schema(self, schema: Schema) -> None:
        drop = self.cfg.unknown_fields == "drop"
        self._maker = RowMaker(schema, self.cfg.key, drop)
        self._raw = RawReader(schema, self._maker, drop)
        self._schema_id = schema.schema_id

    def _load_or_create(self, catalog: PartCatalog) -> Table:
        try:
            return catalog.load_table(self.cfg.table)
        except NoSuchTableError:
            if self.cfg.create_table is None:
                raise FatalSinkError(
                    f"table {self.cfg.table} does not exist in catalog {self.cfg.catalog.name!r}:"
                    " create it, or set create_table",
                    sink=self.name,
                ) from None
        with contextlib.suppress(NamespaceAlreadyExistsError):
            catalog.create_namespace(self.cfg.namespace)
        schema = self._schema_to_create()
        try:
            return catalog.create_table(
                self.cfg.table,
                schema=schema,
                partition_spec=self._spec_to_create(schema),
                properties=TABLE_PROPERTIES,
            )
        except TableAlreadyExistsError:  # another participant made it meanwhile
            return catalog.load_table(self.cfg.table)

    def _schema_to_create(self) -> Schema:
        assert self.cfg.create_table is not None
        fields = []
        for i, (name, spelled) in enumerate(self.cfg.create_table.items(), start=1):
            kind = spelled.strip().lower()
            if kind.startswith("decimal"):
                p, s = kind[kind.index("(") + 1 : kind.index(")")].split(",")
                field_type: PrimitiveType = DecimalType(int(p), int(s))
            else:
                field_type = BY_NAME[kind]
            fields.append(NestedField(i, name, field_type, required=name in self.cfg.key))
        ids = [f.field_id for f in fields if f.name in self.cfg.key]
        return Schema(*fields, identifier_field_ids=ids)

    def _spec_to_create(self, schema: Schema) -> PartitionSpec:
        fields = []
        for i, item in enumerate(self.cfg.partition_by):
            m = PARTITION_PATTERN.fullmatch(item)
            assert m is not None
            fn, n = (m.group("fn"), m.group("n")) if m.group("fn") else ("identity", None)
            column = m.group("col") or m.group("bare")
            transform: Transform[Any, Any] = _TRANSFORMS[fn](n)
            name = column if fn == "identity" else f"{column}_{fn}" + (f"_{n}" if n else "")
            fields.append(
                PartitionField(
                    source_id=schema.find_field(column).field_id,
                    field_id=1000 + i,
                    transform=transform,
                    name=name,
                )
            )
        return PartitionSpec(*fields)

    def close(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        if self._catalog is not None:
            self._catalog.engine.dispose()

    # -- connections ---------------------------------------------------------------------------

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """This thread's connection to the catalog's database (autocommit; transactions are
        opened explicitly). A connection that broke is replaced on the next call."""
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = connect(self.cfg.catalog, autocommit=True)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        yield conn

    @contextmanager
    def _store(self, action: str) -> Iterator[psycopg.Connection[Any]]:
        """This thread's connection; a failure of the database or the warehouse is retriable."""
        try:
            with self._conn() as conn:
                yield conn
        except _STORE_ERRORS as exc:
            raise RetriableSinkError(f"{action}: {exc}", sink=self.name) from exc

    def _table(self) -> Table:
        if self._catalog is None:
            raise FatalSinkError("setup() has not run", sink=self.name)
        return self._catalog.load_table(self.cfg.table)

    # -- maintenance (twophase sinks maintain) ---------------------------------------------------

    def maintain(self) -> dict[str, Any]:
        """Compact small files, expire old snapshots, delete unreferenced files
        (:mod:`._maintain`), by the ``maintenance`` settings; what it did."""
        try:
            return maintain(self).asdict()
        except (CommitFailedException, ValidationException) as exc:
            raise RetriableSinkError(f"maintain: {exc}", sink=self.name) from exc

    @property
    def parts(self) -> Parts:
        return self._parts

    def load_table(self) -> Table:
        return self._table()

    def store_connection(self, action: str) -> contextlib.AbstractContextManager[Any]:
        return self._store(action)

    def catalog_bound(
        self, conn: psycopg.Connection[Any]
    ) -> contextlib.AbstractContextManager[None]:
        assert self._catalog is not None
        return self._catalog.bound(conn)

    # -- the store operations of BatchingSink ---------------------------------------------------

    def stage(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        rows_of = self._slot.get(part)
        if rows_of is None or self._maker is None:
            raise AbortTransactionError(f"part {part.token} is not open here", sink=self.name)
        rejected: list[Rejected] = []
        if self.cfg.auto_evolve:
            records, rejected = self._evolve(records, rows_of)
        maker = self._maker
        assert maker is not None
        keyed = rows_of.keyed
        rows: list[list[Any]] = []
        at: list[int] = []
        changes: list[tuple[tuple[Any, ...], int]] = []  # (key, record position or -1)
        for i, record in enumerate(records):
            if record.deleted:
                if not keyed:
                    rejected.append(Rejected(record, "a delete needs upsert mode and a key"))
                    continue
                key = maker.key_of(record)
                if isinstance(key, str):
                    rejected.append(Rejected(record, key))
                else:
                    changes.append((key, -1))
                continue
            row = maker.row(record)
            if isinstance(row, str):
                rejected.append(Rejected(record, row))
                continue
            rows.append(row)
            at.append(i)
            if keyed:
                changes.append((maker.key_of_row(row), i))
        batch, refused, kept = maker.batches(records, rows, at)
        rejected += refused
        place = {i: n for n, i in enumerate(kept)}
        rows_of.add(
            batch,
            [(key, None if i < 0 else place[i]) for key, i in changes if i < 0 or i in place],
        )
        return rejected

    def stage_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected] | None:
        rows_of = self._slot.get(part)
        if rows_of is None or rows_of.keyed or self._raw is None:
            return None
        table = self._raw.read(batch.values)
        if table is None:
            return None
        for chunk in table.to_batches():
            rows_of.add(chunk)
        return []

    def _evolve(
        self, records: Sequence[Record], rows_of: PartRows
    ) -> tuple[Sequence[Record], list[Rejected]]:
        """``auto_evolve``: the table's schema made to hold every record's schema (each new
        schema once), and the records whose schema it cannot hold, refused."""
        refusals: dict[str, str] = {}
        for record in records:
            schema = record.schema
            if schema is None or schema.id in refusals:
                continue
            why = self._fit(schema)
            if why is not None:
                refusals[schema.id] = why
        if rows_of.maker is not self._maker:
            assert self._maker is not None
            rows_of.follow(self._maker)
        if not refusals:
            return records, []
        kept = [r for r in records if r.schema is None or r.schema.id not in refusals]
        rejected = [
            Rejected(r, refusals[r.schema.id])
            for r in records
            if r.schema is not None and r.schema.id in refusals
        ]
        return kept, rejected

    def _fit(self, schema: sdk.RecordSchema) -> str | None:
        """None once the table holds ``schema``'s records (changed if it must), else why not.
        The rows follow the table's current schema, whoever changed it."""
        key = (schema.id, self._schema_id)
        if key in self._fits:
            return self._fits[key]
        current = self._table().schema()
        changes, why = _evolve.plan(current, schema)
        if why is None and changes:
            with (
                self._store("evolve the table's schema") as conn,
                locked_table(self, conn) as table,
            ):
                # Again under the lock: another participant may have made the change.
                changes, why = _evolve.plan(table.schema(), schema)
                if why is None and changes:
                    tx = _evolve.apply(table, changes)
                    with self.catalog_bound(conn):
                        tx.commit_transaction()
                    self.log.info(
                        "iceberg sink %s: table %s changed for schema %s: %s",
                        self.name,
                        self.cfg.table,
                        schema.id,
                        ", ".join(f"{c.kind} {c.name}" for c in changes),
                    )
            current = self._table().schema()
        if current.schema_id != self._schema_id:
            self._use_schema(current)
        self._fits[(schema.id, self._schema_id)] = why
        return why

    def publish(self, part: PartId) -> None:
        with self._store("commit") as conn:
            while True:
                try:
                    with conn.transaction():
                        found = self._parts.lock(conn, part)
                        if found is None or found[0] != "prepared":
                            return  # committed already, or not prepared: the caller checks
                        _, positions, prepared = found
                        self._commit_files(conn, part, prepared, positions)
                        self._parts.set_state(conn, part, "committed")
                        self._parts.raise_positions(conn, part.pipeline, positions)
                    return
                except (CommitFailedException, ValidationException) as exc:
                    # Another writer's commit won the table pointer after pyiceberg's own
                    # retries: the marker is still prepared; try again on the new head.
                    self.log.info("part %s: commit raced, again: %s", part.token, exc)

    def _commit_files(
        self, conn: psycopg.Connection[Any], part: PartId, prepared: Any, positions: Any
    ) -> None:
        """Inside ``conn``'s transaction: delete the part's keys (upsert) and append its files,
        in one snapshot, the table pointer swapped on ``conn``."""
        assert self._catalog is not None
        keys = prepared.get("keys") or []
        if not prepared.get("manifest") and not keys:
            return
        table = self._table()
        files = _read_manifest(table, prepared) if prepared.get("manifest") else []
        if files and table.spec().spec_id != prepared["spec_id"]:
            raise FatalSinkError(
                f"part {part.token}: the table's partition spec changed between its prepare "
                f"(spec {prepared['spec_id']}) and its commit (spec {table.spec().spec_id});"
                " change a spec only when no part is in doubt (twophase txn list)",
                sink=self.name,
            )
        summary = {PART_KEY: part.token, SINK_KEY: self.name}
        with self._catalog.bound(conn):
            tx = table.transaction()
            if keys:
                with warnings.catch_warnings():
                    # "did not match any records": new keys have no rows to delete.
                    warnings.simplefilter("ignore", UserWarning)
                    tx.delete(self._keys_filter(keys), snapshot_properties=summary)
            if files:
                with tx.update_snapshot(snapshot_properties=summary).merge_append() as append:
                    for data_file in files:
                        append.append_data_file(data_file)
            tx.commit_transaction()

    def _keys_filter(self, keys: list[list[Any]]) -> BooleanExpression:
        columns = self.cfg.key
        assert self._maker is not None
        arrow = self._maker.arrow
        typed = [_from_json(k, [arrow.field(c).type for c in columns]) for k in keys]
        if len(columns) == 1:
            chunks = [
                In(columns[0], [k[0] for k in typed[i : i + _IN_CHUNK]])  # type: ignore[call-arg,arg-type]
                for i in range(0, len(typed), _IN_CHUNK)
            ]
            return chunks[0] if len(chunks) == 1 else Or(*chunks)
        terms: list[BooleanExpression] = [
            And(*[EqualTo(c, v) for c, v in zip(columns, k, strict=True)])  # type: ignore[call-arg,arg-type]
            for k in typed
        ]
        return terms[0] if len(terms) == 1 else Or(*terms)

    def discard(self, part: PartId) -> None:
        self._slot.get(part, take=True)
        with self._store("abort") as conn:
            with conn.transaction():
                found = self._parts.lock(conn, part)
                if found is not None and found[0] == "committed":
                    # A commit won the marker's lock first (a zombie's abort raced it).
                    raise FatalSinkError(
                        f"abort: part {part.token} is already committed", sink=self.name
                    )
                if found is None or found[0] == "aborted":
                    return
                self._parts.set_state(conn, part, "aborted")
                prepared = found[2]
            # The marker says aborted, and a commit takes the marker's lock first: nothing
            # can reference these files any more.
            if prepared:
                self._delete_files(prepared)

    def _delete_files(self, prepared: dict[str, Any]) -> None:
        assert self._catalog is not None
        io = self._table().io
        for path in [*prepared.get("files", []), prepared.get("manifest")]:
            if path:
                try:
                    io.delete(path)
                except (FileNotFoundError, OSError) as exc:
                    self.log.info("iceberg sink %s: could not delete %s: %s", self.name, path, exc)

    def save_marker(self, marker: PartMarker, *, expect: Collection[PartState | None]) -> bool:
        part = marker.part
        prepared: dict[str, Any] | None = None
        if marker.state == "open":
            assert self._maker is not None
            rows = PartRows(self._maker, keyed=self.cfg.mode == "upsert")
        elif marker.state == "prepared":
            rows_of = self._slot.get(part)
            if rows_of is None:
                raise AbortTransactionError(
                    f"part {part.token}: its rows are gone (aborted meanwhile)", sink=self.name
                )
            prepared = self._write_files(part, rows_of)
        with self._store("marker") as conn, conn.transaction():
            saved = self._parts.save(
                conn, marker, expect, positions_to_json(marker.positions), prepared
            )
        if not saved:
            if prepared:
                self._delete_files(prepared)
            return False
        if marker.state == "open":
            self._slot.put(part, rows)
        elif marker.state == "prepared":
            self._slot.get(part, take=True)
        return True

    def _write_files(self, part: PartId, rows_of: PartRows) -> dict[str, Any]:
        """The part's data files and their manifest, durable, referenced by nothing yet."""
        assert self._catalog is not None
        try:
            table = self._table()
            data = rows_of.table()
            prepared: dict[str, Any] = {
                "spec_id": table.spec().spec_id,
                "schema_id": table.schema().schema_id,
                "keys": [_to_json(k) for k in rows_of.touched_keys()] if rows_of.keyed else [],
                "files": [],
                "manifest": None,
            }
            if data.num_rows == 0:
                return prepared
            _check_pyarrow_schema_compatible(
                table.schema(), data.schema, format_version=table.format_version
            )
            write_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"twophase/{self.name}/{part.token}")
            files = list(
                _dataframe_to_data_files(
                    table_metadata=table.metadata, df=data, io=table.io, write_uuid=write_uuid
                )
            )
            _fsync_dirs(table.location(), [f.file_path for f in files])
            prepared["files"] = [f.file_path for f in files]
            prepared.update(_write_manifest(table, part, files, write_uuid))
            return prepared
        except _STORE_ERRORS as exc:
            raise RetriableSinkError(f"prepare: writing data files: {exc}", sink=self.name) from exc
        except (ValueError, pa.ArrowException) as exc:
            raise AbortTransactionError(f"prepare: {exc}", sink=self.name) from exc

    def load_marker(self, part: PartId) -> PartMarker | None:
        with self._store("marker") as conn:
            found = self._parts.load(conn, part)
        if found is None:
            return None
        state, positions, records = found
        return PartMarker(part, state, positions_from_json(positions), records)  # type: ignore[arg-type]

    def list_parts(self, state: PartState) -> list[PartId]:
        with self._store("list parts") as conn:
            tokens = self._parts.tokens(conn, self.context.pipeline, state)
        return sorted(PartId.parse(t) for t in tokens)

    # -- housekeeping --------------------------------------------------------------------------

    def committed_positions(self) -> dict[sdk.TopicPartition, int]:
        with self._store("committed positions") as conn:
            return self._parts.committed_positions(conn, self.context.pipeline)

    def last_committed(self) -> sdk.CommittedInfo | None:
        with self._store("last committed") as conn:
            found = self._parts.last_committed(conn, self.context.pipeline)
        if found is None:
            return None
        txn, participant, at = found
        return sdk.CommittedInfo(PartId(self.context.pipeline, txn, participant), at)

    def forget(self, before_txn: int) -> int:
        with self._store("forget") as conn:
            return self._parts.forget(conn, self.context.pipeline, before_txn)


# -- the prepared part: data files and their manifest --------------------------------------------


def _write_manifest(
    table: Table, part: PartId, files: list[DataFile], write_uuid: uuid.UUID
) -> dict[str, Any]:
    """An Avro manifest of the part's data files (Iceberg's own record of a data file: path,
    partition, counts, column bounds) beside the table's metadata, read back at commit."""
    path = f"{table.location()}/metadata/twophase-{write_uuid}.avro"
    writer = write_manifest(
        format_version=table.format_version,
        spec=table.spec(),
        schema=table.schema(),
        output_file=table.io.new_output(path),
        snapshot_id=part.txn,
        avro_compression="deflate",
    )
    with writer:
        for data_file in files:
            writer.add(
                ManifestEntry.from_args(
                    status=ManifestEntryStatus.ADDED, snapshot_id=part.txn, data_file=data_file
                )
            )
    manifest = writer.to_manifest_file()
    return {"manifest": path, "manifest_length": manifest.manifest_length}


def _read_manifest(table: Table, prepared: dict[str, Any]) -> list[DataFile]:
    manifest = ManifestFile.from_args(
        manifest_path=prepared["manifest"],
        manifest_length=prepared["manifest_length"],
        partition_spec_id=prepared["spec_id"],
        content=ManifestContent.DATA,
        sequence_number=0,
        min_sequence_number=0,
        added_snapshot_id=0,
    )
    return [e.data_file for e in manifest.fetch_manifest_entry(table.io)]


def _fsync_dirs(location: str, paths: list[str]) -> None:
    """fsync the parents of the directories new data files went into, up to the table's
    location: a partition directory made for them is an entry in its parent. (The FileIO
    fsynced each file and its own directory when it closed it.) Local warehouses only."""
    if not location.startswith("file:") and not location.startswith("/"):
        return
    root = urlparse(location).path if location.startswith("file:") else location
    seen: set[str] = set()
    for path in paths:
        local = urlparse(path).path if path.startswith("file:") else path
        directory = os.path.dirname(os.path.dirname(local))
        while directory.startswith(root) and directory not in seen:
            seen.add(directory)
            fsync_dir(Path(directory))
            directory = os.path.dirname(directory)


def _to_json(key: tuple[Any, ...]) -> list[Any]:
    """A key as JSON: numbers and strings as they are, the rest as text."""
    return [v if isinstance(v, (int, str)) and not isinstance(v, bool) else str(v) for v in key]


def _from_json(key: list[Any], types: list[pa.DataType]) -> list[Any]:
    """A key :func:`_to_json` wrote, in the values pyiceberg's expressions compare."""
    out: list[Any] = []
    for v, t in zip(key, types, strict=True):
        if pa.types.is_decimal(t):
            out.append(Decimal(v))
        else:
            out.append(v)
    return out
