"""Exactly-once SQLite sink for twophase, written only against the public participant SDK.

One database file holds the target table, a staging table of the same shape (same types and
CHECKs, so a bad row is refused at write time, not at commit) and the markers. A commit is one
SQLite transaction: staged rows move to the target, the marker flips and records the commit time,
the positions are stored.

With ``key`` set the sink keeps one row per key and applies deletes (change data capture): a
part's changes are staged in order (``_seq``), deletes in a table of their own (a delete carries
only the key, so it could not pass the target's NOT NULLs), and the commit replaces the rows of
every key the part touched by the last change of that key -- a delete removes it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pydantic

from twophase.participants import sdk

__all__ = ["SqliteSink", "SqliteSinkConfig"]

#: How long a transaction waits for another writer of the file; ours take milliseconds.
BUSY_TIMEOUT_S = 30.0
_PART = "sink = ? AND token = ?"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS twophase_parts (sink, token, pipeline, txn, participant, state,
    positions, records, committed_at, PRIMARY KEY (sink, token));
CREATE TABLE IF NOT EXISTS twophase_positions (sink, pipeline, topic, partition, next,
    PRIMARY KEY (sink, pipeline, topic, partition));
CREATE TABLE IF NOT EXISTS "{t}" ({columns}) STRICT;
CREATE TABLE IF NOT EXISTS "{t}__staging" (_part TEXT, {columns}) STRICT;
CREATE INDEX IF NOT EXISTS "{t}__staging_part" ON "{t}__staging" (_part)"""
#: With ``key``: the staged order of a part's changes, and its deletes.
_KEYED_SCHEMA = """
CREATE TABLE IF NOT EXISTS "{t}__staging" (_part TEXT, _seq INTEGER, {columns}) STRICT;
CREATE TABLE IF NOT EXISTS "{t}__deletes" (_part TEXT, _seq INTEGER, _key ANY) STRICT;
CREATE INDEX IF NOT EXISTS "{t}__deletes_part" ON "{t}__deletes" (_part)"""


class SqliteSinkConfig(sdk.SinkConfig):
    type: Literal["sqlite"]
    path: Path
    table: str
    #: Column -> column definition, e.g. ``{"n": "INTEGER NOT NULL CHECK (n >= 0)"}``, filled
    #: from the record value's field of the same name.
    columns: dict[str, str]
    #: A column of ``columns`` that identifies a row: the table keeps the last change of each
    #: key, and the sink applies deletes. Without it every record is a new row (append).
    key: str | None = None

    @pydantic.model_validator(mode="after")
    def _key_is_a_column(self) -> SqliteSinkConfig:
        if self.key is not None and self.key not in self.columns:
            raise ValueError(f"key {self.key!r} is not one of columns {sorted(self.columns)}")
        return self


class SqliteSink(sdk.BatchingSink):
    config_model = SqliteSinkConfig

    def __init__(self, config: sdk.SinkConfig, context: sdk.SinkContext) -> None:
        assert isinstance(config, SqliteSinkConfig)
        super().__init__(config, context)
        self.cfg = config
        self._lock = threading.Lock()  # one connection for the data and the control thread
        self._db: sqlite3.Connection | None = None
        self._cols = ", ".join(f'"{c}"' for c in config.columns)
        self._target, self._stage = f'"{config.table}"', f'"{config.table}__staging"'
        self._deletes = f'"{config.table}__deletes"'

    @property
    def supports_deletes(self) -> bool:
        return self.cfg.key is not None

    def setup(self) -> None:
        db = self._db = sqlite3.connect(
            self.cfg.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")  # every COMMIT is durable
        columns = ", ".join(f'"{c}" {d}' for c, d in self.cfg.columns.items())
        schema = (_KEYED_SCHEMA + ";" if self.cfg.key else "") + _SCHEMA  # keyed staging first
        with self._tx("setup", sdk.FatalSinkError):
            for ddl in schema.format(t=self.cfg.table, columns=columns).split(";"):
                db.execute(ddl)
            if "committed_at" not in {
                c[1] for c in db.execute("PRAGMA table_info(twophase_parts)")
            }:
                db.execute("ALTER TABLE twophase_parts ADD COLUMN committed_at")  # older file
            staged = {c[1] for c in db.execute(f"PRAGMA table_info({self._stage})")}
            if self.cfg.key and "_seq" not in staged:
                raise sdk.FatalSinkError(
                    f"key: {self._stage} was made without a key; drop it (when no part is"
                    " in doubt) to add one",
                    sink=self.name,
                )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
            self._db = None

    @contextmanager
    def _tx(self, what: str, failure: type[sdk.SinkError]) -> Iterator[sqlite3.Connection]:
        """One SQLite transaction; a busy database is retriable, any other error ``failure``."""
        with self._lock:
            if (db := self._db) is None:
                raise sdk.FatalSinkError("setup() has not run", sink=self.name)
            try:
                db.execute("BEGIN IMMEDIATE")  # take the write lock now, not half-way through
                try:
                    yield db
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                busy = isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)
                error = sdk.RetriableSinkError if busy else failure
                raise error(f"{what}: {exc}", sink=self.name) from exc

    def _query(self, sql: str, *args: Any) -> list[Any]:
        with self._tx("query", sdk.RetriableSinkError) as db:
            return db.execute(sql, args).fetchall()

    # -- the six store operations of BatchingSink --

    def stage(self, part: sdk.PartId, records: Sequence[sdk.Record]) -> list[sdk.Rejected]:
        key = self.cfg.key
        marks = ", ".join("?" * (len(self.cfg.columns) + 1 + bool(key)))
        seq = "_seq, " if key else ""
        insert = f"INSERT INTO {self._stage} (_part, {seq}{self._cols}) VALUES ({marks})"
        rejected = []
        with self._tx("write", sdk.AbortTransactionError) as db:
            n = self._last_seq(db, part) if key else 0
            for r in records:
                n += 1
                if r.deleted and (key is None or r.value.get(key) is None):
                    why = "a delete needs a key" if key else "this sink has no key to delete by"
                    rejected.append(sdk.Rejected(r, f"{why} (key: {key!r})"))
                    continue
                try:  # a refused row undoes only its own statement
                    if r.deleted:
                        sql = f"INSERT INTO {self._deletes} VALUES (?, ?, ?)"
                        db.execute(sql, (part.token, n, r.value[key]))
                        continue
                    values = [r.value.get(c) for c in self.cfg.columns]
                    db.execute(insert, [part.token, *([n] if key else []), *values])
                except (sqlite3.IntegrityError, sqlite3.ProgrammingError, OverflowError) as exc:
                    rejected.append(sdk.Rejected(r, f"sqlite refused the row: {exc}"))
        return rejected

    def _last_seq(self, db: sqlite3.Connection, part: sdk.PartId) -> int:
        """Where the part's next change goes in its order (its writes may span stage calls)."""
        sql = (
            f"SELECT max(coalesce((SELECT max(_seq) FROM {self._stage} WHERE _part = ?1), 0),"
            f" coalesce((SELECT max(_seq) FROM {self._deletes} WHERE _part = ?1), 0))"
        )
        return int(db.execute(sql, (part.token,)).fetchone()[0])

    def _apply(self, db: sqlite3.Connection, part: sdk.PartId) -> None:
        """Move a part's staged rows to the target; with a key, its last change per key."""
        token = (part.token,)
        if (key := self.cfg.key) is None:
            db.execute(
                f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols}"
                f" FROM {self._stage} WHERE _part = ? ORDER BY rowid",
                token,
            )
            return
        k = f'"{key}"'
        db.execute(
            f"DELETE FROM {self._target} WHERE {k} IN (SELECT {k} FROM {self._stage}"
            f" WHERE _part = ?1 UNION SELECT _key FROM {self._deletes} WHERE _part = ?1)",
            token,
        )
        db.execute(  # a key's last staged write, unless a delete of the key came after it
            f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols} FROM {self._stage} s"
            f" WHERE _part = ?1 AND _seq = (SELECT max(_seq) FROM {self._stage}"
            f" WHERE _part = ?1 AND {k} = s.{k}) AND NOT EXISTS (SELECT 1 FROM {self._deletes}"
            f" WHERE _part = ?1 AND _key = s.{k} AND _seq > s._seq)",
            token,
        )

    def _unstage(self, db: sqlite3.Connection, part: sdk.PartId) -> None:
        db.execute(f"DELETE FROM {self._stage} WHERE _part = ?", (part.token,))
        if self.cfg.key:
            db.execute(f"DELETE FROM {self._deletes} WHERE _part = ?", (part.token,))

    def publish(self, part: sdk.PartId) -> None:
        key = (self.name, part.token)
        with self._tx("commit", sdk.RetriableSinkError) as db:
            sql = f"SELECT positions FROM twophase_parts WHERE {_PART} AND state = 'prepared'"
            if (row := db.execute(sql, key).fetchone()) is None:
                return  # committed already, or not prepared: the caller checks which
            self._apply(db, part)
            self._unstage(db, part)
            db.execute(
                "UPDATE twophase_parts SET state = 'committed',"
                f" committed_at = strftime('%Y-%m-%dT%H:%M:%fZ') WHERE {_PART}",  # UTC
                key,
            )
            db.executemany(
                "INSERT INTO twophase_positions VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO UPDATE SET next = max(next, excluded.next)",
                [(self.name, part.pipeline, t, p, n) for t, p, n in json.loads(row[0])],
            )

    def discard(self, part: sdk.PartId) -> None:
        with self._tx("abort", sdk.RetriableSinkError) as db:
            sql = f"UPDATE twophase_parts SET state = 'aborted' WHERE {_PART} AND state != ?"
            db.execute(sql, (self.name, part.token, "committed"))
            self._unstage(db, part)

    def save_marker(self, marker: sdk.PartMarker, *, expect: Collection[str | None]) -> bool:
        p, key = marker.part, (self.name, marker.part.token)
        positions = json.dumps([[t, n, o] for (t, n), o in sorted(marker.positions.items())])
        with self._tx("marker", sdk.RetriableSinkError) as db:
            row = db.execute(f"SELECT state FROM twophase_parts WHERE {_PART}", key).fetchone()
            if (row or (None,))[0] not in expect:
                return False
            row = (*key, p.pipeline, p.txn, p.participant, marker.state, positions, marker.records)
            db.execute(
                "INSERT OR REPLACE INTO twophase_parts (sink, token, pipeline, txn, participant,"
                " state, positions, records) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        return True

    def load_marker(self, part: sdk.PartId) -> sdk.PartMarker | None:
        sql = f"SELECT state, positions, records FROM twophase_parts WHERE {_PART}"
        for state, positions, records in self._query(sql, self.name, part.token):
            positions = {(t, n): o for t, n, o in json.loads(positions)}
            return sdk.PartMarker(part, state, positions, records)
        return None

    def list_parts(self, state: sdk.PartState) -> list[sdk.PartId]:
        sql = "SELECT token FROM twophase_parts WHERE sink = ? AND pipeline = ? AND state = ?"
        found = self._query(sql, self.name, self.context.pipeline, state)
        return [sdk.PartId.parse(token) for (token,) in found]

    # -- housekeeping --

    def committed_positions(self) -> dict[sdk.TopicPartition, int]:
        sql = "SELECT topic, partition, next FROM twophase_positions WHERE sink=? AND pipeline=?"
        return {(t, n): o for t, n, o in self._query(sql, self.name, self.context.pipeline)}

    def last_committed(self) -> sdk.CommittedInfo | None:
        sql = (
            "SELECT txn, participant, committed_at FROM twophase_parts WHERE sink = ?"
            " AND pipeline = ? AND state = 'committed' ORDER BY txn DESC, committed_at DESC LIMIT 1"
        )
        for txn, participant, at in self._query(sql, self.name, self.context.pipeline):
            when = datetime.fromisoformat(at).replace(tzinfo=UTC) if at else None
            return sdk.CommittedInfo(sdk.PartId(self.context.pipeline, txn, participant), when)
        return None

    def forget(self, before_txn: int) -> int:
        """Decided markers older than ``before_txn``, but those of the newest committed txn."""
        newest = "SELECT max(txn) FROM twophase_parts WHERE sink = ?1 AND pipeline = ?2"
        newest += " AND state = 'committed'"
        sql = "DELETE FROM twophase_parts WHERE sink = ?1 AND pipeline = ?2"
        sql += f" AND state IN ('committed', 'aborted') AND txn < min(?3, coalesce(({newest}), ?3))"
        with self._tx("forget", sdk.RetriableSinkError) as db:
            return db.execute(sql, (self.name, self.context.pipeline, before_txn)).rowcount
