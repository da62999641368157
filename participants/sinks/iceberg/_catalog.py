"""The SQL catalog, made to commit inside the sink's own PostgreSQL transaction.

pyiceberg's :class:`~pyiceberg.catalog.sql.SqlCatalog` commits a table by writing a new
metadata file and then swapping the table's row in ``iceberg_tables`` from the metadata it
read to the new one (a compare-and-set ``UPDATE``), in a session of its own. :class:`PartCatalog`
does the same swap on a connection the sink passes (:meth:`PartCatalog.bound`), inside that
connection's open transaction -- the one that holds the part's marker row locked and then marks
it committed. The table's new snapshot and the part's ``committed`` become visible together or
not at all, and an abort that took the marker first leaves a late commit nothing to swap: that
is the fencing. Two of the catalog's protected methods are used for it
(``_update_and_stage_table``, ``_write_metadata``): pyiceberg is pinned, and
``tests/integration/test_sink_iceberg.py`` fails if they change.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psycopg
from psycopg import sql
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import PyArrowFile, PyArrowFileIO
from pyiceberg.table import CommitTableResponse, Table
from pyiceberg.table.update import TableRequirement, TableUpdate
from sqlalchemy.engine import make_url

from twophase.participants.sdk import fsync_dir
from twophase.participants.sinks.iceberg.config import CatalogConfig

__all__ = ["FsyncFileIO", "PartCatalog", "connect", "open_catalog"]

#: Serialises the first creation of the catalog's tables (pyiceberg checks, then creates: two
#: processes starting at once on an empty schema collide).
_CREATE_LOCK_KEY = 0x7477_6F70_6963_6562  # "twopiceb"


#: libpq ``options`` that make a session's transactions READ COMMITTED by default (pyiceberg's
#: engine; :func:`connect` sets the same on its session).
_READ_COMMITTED = "-cdefault_transaction_isolation=read\\ committed"


def connect(cfg: CatalogConfig, *, autocommit: bool) -> psycopg.Connection[Any]:
    """A psycopg connection to the catalog's database, its transactions READ COMMITTED."""
    password = cfg.password.get_secret_value() if cfg.password is not None else None
    # A None keyword is left out of the connection string.
    conn = psycopg.connect(cfg.uri, autocommit=True, connect_timeout=10, password=password)
    # READ COMMITTED whatever the database's or the role's default (the transactions and the
    # autocommit statements alike): at REPEATABLE READ two participants' commits racing for one
    # table pointer fail ("could not serialize access") instead of the later one finding the
    # pointer moved and committing again on the new snapshot.
    # And no idle timeout of the server's or the role's ends the connection (a thread's is
    # kept between parts: ended, a part's next step failed).
    try:
        conn.execute(
            "SELECT set_config('default_transaction_isolation', 'read committed', false),"
            " set_config('idle_in_transaction_session_timeout', '0', false)"
        )
        if conn.info.server_version >= 140000:  # idle_session_timeout is PostgreSQL 14's
            conn.execute("SELECT set_config('idle_session_timeout', '0', false)")
    except BaseException:
        conn.close()
        raise
    conn.autocommit = autocommit
    return conn


def _sqlalchemy_uri(cfg: CatalogConfig) -> str:
    """The catalog URI for SQLAlchemy: psycopg 3 as the driver, the catalog's schema first
    and alone on the search path (so a ``public.iceberg_tables`` is never picked up), READ
    COMMITTED (see :func:`connect`) -- after the URI's own ``options``, which are kept."""
    url = make_url(cfg.uri).set(drivername="postgresql+psycopg")
    if cfg.password is not None:
        url = url.set(password=cfg.password.get_secret_value())
    query = dict(url.query)
    given = query.get("options", "")
    given = " ".join(given) if isinstance(given, tuple) else given
    query["options"] = f"{given} -csearch_path={cfg.schema_} {_READ_COMMITTED}".strip()
    return url.set(query=query).render_as_string(hide_password=False)


class PartCatalog(SqlCatalog):
    """A SQL catalog whose commits can join a transaction of the caller's (:meth:`bound`)."""

    def __init__(self, name: str, schema: str, **properties: str) -> None:
        self._bound = threading.local()
        self._tables = sql.Identifier(schema, "iceberg_tables")
        super().__init__(name, **properties)

    @contextmanager
    def bound(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Commits of this thread swap the table pointer on ``conn``, in its open transaction,
        which the caller commits (or rolls back: then the table is as before)."""
        self._bound.conn = conn
        try:
            yield
        finally:
            self._bound.conn = None

    def commit_table(
        self,
        table: Table,
        requirements: tuple[TableRequirement, ...],
        updates: tuple[TableUpdate, ...],
    ) -> CommitTableResponse:
        conn: psycopg.Connection[Any] | None = getattr(self._bound, "conn", None)
        if conn is None:
            return super().commit_table(table, requirements, updates)
        identifier = table.name()
        namespace = self.namespace_to_string(self.namespace_from(identifier))
        name = self.table_name_from(identifier)
        current = self.load_table(identifier)
        staged = self._update_and_stage_table(current, identifier, requirements, updates)
        if staged.metadata == current.metadata:
            return _response(current.metadata, current.metadata_location)
        self._write_metadata(
            metadata=staged.metadata, io=staged.io, metadata_path=staged.metadata_location
        )
        cur = conn.execute(
            sql.SQL(
                "UPDATE {} SET metadata_location = %s, previous_metadata_location = %s"
                " WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s"
                " AND metadata_location = %s"
            ).format(self._tables),
            (
                staged.metadata_location,
                current.metadata_location,
                self.name,
                namespace,
                name,
                current.metadata_location,
            ),
        )
        if cur.rowcount < 1:
            raise CommitFailedException(f"table {namespace}.{name} changed meanwhile")
        return _response(staged.metadata, staged.metadata_location)


def _response(metadata: Any, location: str) -> CommitTableResponse:
    # pydantic model: the field is populated by name (mypy knows only its alias).
    return CommitTableResponse(metadata=metadata, metadata_location=location)  # type: ignore[call-arg]


def open_catalog(cfg: CatalogConfig) -> PartCatalog:
    """The catalog, its schema and tables made first when missing (under an advisory lock)."""
    properties = {
        "uri": _sqlalchemy_uri(cfg),
        "warehouse": cfg.warehouse,
        "init_catalog_tables": "true",
        "pool_pre_ping": "true",
        "py-io-impl": f"{FsyncFileIO.__module__}.{FsyncFileIO.__qualname__}",
        **cfg.properties,
    }
    with connect(cfg, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_CREATE_LOCK_KEY,))
        try:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(cfg.schema_))
            )
            return PartCatalog(cfg.name, cfg.schema_, **properties)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_CREATE_LOCK_KEY,))


# -- durable files on a local warehouse ---------------------------------------------------------


def fsync_path(path: str) -> None:
    """fsync a file and its directory (a file on the local file system, ``file://`` or bare)."""
    local = urlparse(path).path if path.startswith("file:") else path
    fd = os.open(local, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(Path(local).parent)


class _FsyncStream:
    """An output stream that fsyncs its file (and the file's directory) when closed."""

    def __init__(self, inner: Any, path: str) -> None:
        self._inner = inner
        self._path = path

    def write(self, data: bytes) -> int:
        return int(self._inner.write(data))

    def tell(self) -> int:
        return int(self._inner.tell())

    def flush(self) -> None:
        self._inner.flush()

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self._inner.closed:
            self._inner.close()
            fsync_path(self._path)

    def __enter__(self) -> _FsyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FsyncFile(PyArrowFile):
    def create(self, overwrite: bool = False) -> Any:
        return _FsyncStream(super().create(overwrite=overwrite), self._path)


class FsyncFileIO(PyArrowFileIO):
    """pyiceberg's Arrow FileIO, but every file written on a local warehouse is fsynced with
    its directory when closed: data files at prepare, manifests and metadata at commit. Arrow's
    local file system never fsyncs, and a durable catalog row must not point at metadata a
    power cut can take. Object stores (``s3://``) make a completed upload durable themselves."""

    def new_output(self, location: str) -> PyArrowFile:
        out = super().new_output(location)
        scheme, _, _ = self.parse_location(location, self.properties)
        if scheme not in ("file", ""):
            return out
        durable = _FsyncFile.__new__(_FsyncFile)
        durable.__dict__.update(out.__dict__)
        return durable
