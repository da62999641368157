"""Table maintenance: compaction of small files, snapshot expiry, removal of unreferenced files.

At one commit a second a table piles up small data files and snapshots (and pyiceberg's commit
re-reads the whole metadata, so it slows down as they grow). :func:`maintain` is what
``twophase sinks maintain`` runs; each step that changes the table does so holding the table's
row in ``iceberg_tables`` locked (``FOR UPDATE``) in the transaction that swaps its pointer, so
no sink commit lands in the middle of it -- commits wait for the lock, then rebuild on the new
head -- and it never races one.

Files are deleted only when no snapshot the table still has references them, no prepared part
lists them, and they are older than ``orphan_grace_s``: a reader that planned a scan on a
snapshot before it was expired keeps its files for that long.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow.fs as pafs
from psycopg import sql
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.table import Table
from pyiceberg.table.update.snapshot import ExpireSnapshots

if TYPE_CHECKING:
    from twophase.participants.sinks.iceberg.sink import IcebergSink

__all__ = ["MaintenanceReport", "locked_table", "maintain"]

#: Snapshot summary key of a maintenance commit.
MAINTENANCE_KEY = "twophase.maintenance"


@dataclass
class MaintenanceReport:
    table: str
    files_compacted: int = 0
    files_written: int = 0
    snapshots_expired: int = 0
    snapshots_kept: int = 0
    files_deleted: int = 0
    seconds: float = 0.0

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def maintain(sink: IcebergSink) -> MaintenanceReport:
    """Compact, expire, then delete unreferenced files, by the sink's ``maintenance`` settings."""
    started = time.monotonic()
    opts = sink.cfg.maintenance
    report = MaintenanceReport(sink.cfg.table)
    with sink.store_connection("maintain") as conn:
        if opts.compact_min_files > 0:
            with locked_table(sink, conn) as table:
                _compact(sink, conn, table, opts.compact_min_files, report)
        with locked_table(sink, conn) as table:
            _expire(sink, conn, table, opts.expire_after_s, opts.keep_snapshots, report)
        _delete_unreferenced(sink, conn, sink.load_table(), opts.orphan_grace_s, report)
    report.seconds = round(time.monotonic() - started, 3)
    return report


@contextmanager
def locked_table(sink: IcebergSink, conn: psycopg.Connection[Any]) -> Iterator[Table]:
    """A transaction holding the table's catalog row: the table as of now, unchanged by any
    commit until the transaction ends (a commit in flight is waited for)."""
    cfg = sink.cfg.catalog
    namespace, name = sink.cfg.table.rsplit(".", 1)
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "SELECT 1 FROM {} WHERE catalog_name = %s AND table_namespace = %s"
                " AND table_name = %s FOR UPDATE"
            ).format(sql.Identifier(cfg.schema_, "iceberg_tables")),
            (cfg.name, namespace, name),
        )
        yield sink.load_table()


def _compact(
    sink: IcebergSink,
    conn: psycopg.Connection[Any],
    table: Table,
    min_files: int,
    report: MaintenanceReport,
) -> None:
    """Rewrite each partition that has ``min_files`` or more files smaller than half the
    target size into as few files as the target size allows, in one overwrite snapshot."""
    if table.current_snapshot() is None:
        return
    target = int(table.properties.get("write.target-file-size-bytes", 512 * 1024 * 1024))
    groups: dict[Any, list[Any]] = {}
    spec_id = table.spec().spec_id
    for task in table.scan().plan_files():
        f = task.file
        if f.spec_id == spec_id and f.file_size_in_bytes < target // 2:
            groups.setdefault(tuple(f.partition._data), []).append(task)
    small = [tasks for tasks in groups.values() if len(tasks) >= min_files]
    if not small:
        return
    written: list[Any] = []
    tx = table.transaction()
    with tx.update_snapshot(snapshot_properties={MAINTENANCE_KEY: "compaction"}).overwrite() as o:
        for tasks in small:
            data = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_table(tasks)
            new = list(
                _dataframe_to_data_files(
                    table_metadata=table.metadata, df=data, io=table.io, write_uuid=uuid.uuid4()
                )
            )
            written += new
            for task in tasks:
                o.delete_data_file(task.file)
            for data_file in new:
                o.append_data_file(data_file)
            report.files_compacted += len(tasks)
    report.files_written = len(written)
    with sink.catalog_bound(conn):
        tx.commit_transaction()


def _expire(
    sink: IcebergSink,
    conn: psycopg.Connection[Any],
    table: Table,
    older_than_s: float,
    keep: int,
    report: MaintenanceReport,
) -> None:
    """Expire snapshots older than ``older_than_s``, but the newest ``keep`` (and every branch
    or tag head)."""
    snapshots = sorted(table.snapshots(), key=lambda s: s.timestamp_ms)
    cutoff = (datetime.now(UTC) - timedelta(seconds=older_than_s)).timestamp() * 1000
    candidates = [s.snapshot_id for s in snapshots[: max(len(snapshots) - keep, 0)]]
    old = [s.snapshot_id for s in snapshots if s.timestamp_ms < cutoff]
    protected = {ref.snapshot_id for ref in table.metadata.refs.values()}
    expire = [i for i in candidates if i in set(old) and i not in protected]
    report.snapshots_kept = len(snapshots) - len(expire)
    if not expire:
        return
    tx = table.transaction()
    ExpireSnapshots(transaction=tx).by_ids(expire).commit()
    with sink.catalog_bound(conn):
        tx.commit_transaction()
    report.snapshots_expired = len(expire)


def _delete_unreferenced(
    sink: IcebergSink,
    conn: psycopg.Connection[Any],
    table: Table,
    grace_s: float,
    report: MaintenanceReport,
) -> None:
    """Delete the table's files that nothing references and that are older than ``grace_s``:
    data files of expired snapshots (compacted or rewritten away), their manifests and manifest
    lists, metadata files past the log, and files of parts that died before their prepare."""
    referenced = _referenced(table) | _prepared(sink, conn)
    scheme, netloc, root = table.io.parse_location(table.location())  # type: ignore[attr-defined]
    fs: pafs.FileSystem = table.io.fs_by_scheme(scheme, netloc)  # type: ignore[attr-defined]
    cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File or info.mtime is None:
            continue
        if _normal(info.path) in referenced:
            continue
        mtime = info.mtime if info.mtime.tzinfo else info.mtime.replace(tzinfo=UTC)
        if mtime >= cutoff:
            continue
        fs.delete_file(info.path)
        report.files_deleted += 1


def _normal(path: str) -> str:
    """A location without its scheme and authority's slashes, to compare file-system paths
    with the table's (``file:///w/x`` and ``/w/x``; ``s3://b/k`` and ``b/k``)."""
    for prefix in ("file://", "s3://", "s3a://"):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def _referenced(table: Table) -> set[str]:
    """Every file a snapshot the table still has reads: its manifest list, its manifests, and
    their live data files (a file a compaction deleted is only a DELETED entry of the
    compaction's manifest: nothing reads it once the snapshots before it are expired)."""
    paths: set[str] = set()
    manifests: set[str] = set()
    for snapshot in table.snapshots():
        if snapshot.manifest_list:
            paths.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in manifests:
                continue
            manifests.add(manifest.manifest_path)
            paths |= {e.data_file.file_path for e in manifest.fetch_manifest_entry(table.io)}
    paths |= manifests
    paths |= {entry.metadata_file for entry in table.metadata.metadata_log}
    paths.add(table.metadata_location)
    return {_normal(p) for p in paths}


def _prepared(sink: IcebergSink, conn: psycopg.Connection[Any]) -> set[str]:
    """Files of parts prepared by any sink of the catalog's schema: a commit will reference
    them."""
    out: set[str] = set()
    for blob in sink.parts.all_prepared(conn):
        out |= {_normal(p) for p in blob.get("files", [])}
        if blob.get("manifest"):
            out.add(_normal(blob["manifest"]))
    return out
