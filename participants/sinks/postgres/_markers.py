"""What the marker table tells: a part's state, the parts left prepared (``in_doubt``), the
committed positions, the newest commit, and forgetting old markers (retention)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import psycopg
from psycopg import sql

from twophase.participants.sdk import (
    CommittedInfo,
    FatalSinkError,
    PartId,
    RetriableSinkError,
    SinkError,
    TopicPartition,
)
from twophase.participants.sinks.postgres._errors import (
    _FATAL_CLASSES,
    Connection,
    _is_lost,
    _sqlstate,
)
from twophase.participants.sinks.postgres._target import _Target

__all__ = ["_Markers"]


class _Markers(_Target):
    """Reads and retention of the marker table."""

    def state(self, part: PartId) -> Literal["prepared", "committed", "unknown"]:
        """What the store says about ``part``: prepared, committed, or unknown (never/aborted)."""
        with self._admin_conn() as conn:
            return self._state(conn, part)

    def _state(self, conn: Connection, part: PartId) -> Literal["prepared", "committed", "unknown"]:
        # Prepared first, marker second: COMMIT PREPARED makes the commit visible before it
        # removes the gid, so a part cannot slip between the two checks.
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()",
            (self.gid(part),),
        ).fetchone()
        if row is not None and row[0]:
            return "prepared"
        return "committed" if self._has_marker(conn, part) else "unknown"

    def _has_marker(self, conn: Connection, part: PartId) -> bool:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {} WHERE pipeline = %s AND sink = %s AND txn = %s"
                " AND participant = %s"
            ).format(self._marker),
            (part.pipeline, self.name, part.txn, part.participant),
        ).fetchone()
        return row is not None and bool(row[0])

    def in_doubt(self) -> list[PartId]:
        self._require_ready()
        prefix = f"{self._gid_prefix}{self.context.pipeline}~"
        with self._admin_conn() as conn:
            rows = conn.execute(
                "SELECT gid FROM pg_prepared_xacts"
                " WHERE database = current_database() AND starts_with(gid, %s) ORDER BY gid",
                (prefix,),
            ).fetchall()
        parts: list[PartId] = []
        for (gid,) in rows:
            try:
                part = PartId.parse(gid[len(self._gid_prefix) :])
            except ValueError:
                self.log.warning("postgres sink %s: ignoring prepared gid %r", self.name, gid)
                continue
            if self.owns(part):
                parts.append(part)
        return sorted(parts)

    def committed_positions(self) -> dict[TopicPartition, int]:
        """Next offset per source partition: the highest stored with a committed part of this
        pipeline and sink.

        Read from the marker rows, which become visible with ``COMMIT PREPARED`` (prepared,
        aborted and other pipelines' or sinks' parts never count), as a ``max`` per partition, so
        decisions applied out of order never move a position back. One query over this pipeline's
        markers (the primary key's prefix), whose number :meth:`forget` keeps bounded.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                with self._no_jit(conn):
                    rows = conn.execute(
                        sql.SQL(
                            "SELECT t.key, p.key::int, max(p.value::bigint)"
                            "  FROM {} m, jsonb_each(m.positions) t, jsonb_each_text(t.value) p"
                            " WHERE m.pipeline = %s AND m.sink = %s"
                            " GROUP BY t.key, p.key"
                        ).format(self._marker),
                        (self.context.pipeline, self.name),
                    ).fetchall()
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("committed_positions", exc) from exc
        return {(str(topic), int(partition)): int(offset) for topic, partition, offset in rows}

    def last_committed(self) -> CommittedInfo | None:
        """The visible marker row of this pipeline and sink with the highest txn (of its parts,
        the one committed last when the server tells, else the highest participant name).

        ``committed_at`` is the commit timestamp of the row's transaction -- the ``COMMIT
        PREPARED`` -- which the server keeps only with ``track_commit_timestamp = on`` (off by
        default; it costs a few bytes per transaction); otherwise it is None. The row's
        ``prepared_at`` is not offered in its place: a part can wait long for its decision.
        Two index lookups on the primary key's prefix.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                setting = conn.execute("SELECT current_setting('track_commit_timestamp')")
                row = setting.fetchone()
                tracked = row is not None and row[0] == "on"
                when = sql.SQL(
                    "pg_xact_commit_timestamp(m.xmin)" if tracked else "NULL::timestamptz"
                )
                row = conn.execute(
                    sql.SQL(
                        "SELECT m.txn, m.participant, {when} AS at FROM {marker} m"
                        " WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s AND m.txn = ("
                        "   SELECT max(txn) FROM {marker}"
                        "    WHERE pipeline = %(pipeline)s AND sink = %(sink)s)"
                        " ORDER BY at DESC NULLS LAST, m.participant DESC LIMIT 1"
                    ).format(when=when, marker=self._marker),
                    {"pipeline": self.context.pipeline, "sink": self.name},
                ).fetchone()
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("last_committed", exc) from exc
        if row is None:
            return None
        txn, participant, committed_at = row
        return CommittedInfo(PartId(self.context.pipeline, int(txn), participant), committed_at)

    def forget(self, before_txn: int) -> int:
        """Delete the marker rows of this pipeline and sink with ``txn < before_txn``; returns
        how many went.

        Only committed parts have a visible marker (a prepared part's row is invisible until
        ``COMMIT PREPARED``, an aborted part's was rolled back with it), so prepared parts and the
        data are never touched. What :meth:`committed_positions` needs is kept: per source
        partition, the marker holding its highest offset (ties: the newest part), whatever its
        txn; and so is what :meth:`last_committed` needs: the markers of the highest txn.
        Concurrent calls are safe: a marker is deleted only by a statement whose snapshot
        sees a better one for each of its partitions and a higher txn, so the best one of each
        partition and the newest stay.

        After this, the store no longer knows a forgotten part: ``commit`` of it raises
        :class:`UnknownPartError`, ``abort`` of it is a no-op, and ``begin`` of its id is
        accepted. Callers pass a ``before_txn`` whose decisions nobody repeats any more (the
        decision log is past it), which is what the SDK asks of them.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                with self._no_jit(conn):
                    cur = conn.execute(
                        sql.SQL(
                            # MATERIALIZED (PostgreSQL 12+): the few keepers are computed
                            # once; inlined, the anti join re-walks the sorted positions of
                            # every marker for each marker (quadratic: 15 s for 5000).
                            """WITH best AS MATERIALIZED (
                                SELECT DISTINCT ON (t.key, p.key) m.txn, m.participant
                                  FROM {marker} m, jsonb_each(m.positions) t,
                                       jsonb_each_text(t.value) p
                                 WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s
                                 ORDER BY t.key, p.key, p.value::bigint DESC, m.txn DESC,
                                          m.participant DESC
                            )
                            DELETE FROM {marker} m
                             WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s
                               AND m.txn < %(before)s
                               AND m.txn < (
                                   SELECT max(n.txn) FROM {marker} n
                                    WHERE n.pipeline = %(pipeline)s AND n.sink = %(sink)s)
                               AND NOT EXISTS (
                                   SELECT 1 FROM best b
                                    WHERE b.txn = m.txn AND b.participant = m.participant)"""
                        ).format(marker=self._marker),
                        {
                            "pipeline": self.context.pipeline,
                            "sink": self.name,
                            "before": before_txn,
                        },
                    )
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("forget", exc) from exc
            deleted = max(cur.rowcount, 0)
        if deleted:
            self.log.info(
                "postgres sink %s: forgot %d markers of parts before txn %d",
                self.name,
                deleted,
                before_txn,
            )
        return deleted

    @staticmethod
    @contextmanager
    def _no_jit(conn: Connection) -> Iterator[None]:
        """One transaction with JIT off: ``jsonb_each`` is estimated at 100 rows per call, so a
        few thousand markers make the planner JIT-compile the statement, which costs ~250 ms for
        a query that runs in a few milliseconds (measured on PostgreSQL 15)."""
        with conn.transaction():
            conn.execute("SET LOCAL jit = off")
            yield

    def _housekeeping_error(self, action: str, exc: psycopg.Error) -> SinkError:
        """Permissions and missing objects are fatal; anything else is retried later."""
        message = f"{action} on {self.cfg.marker_table} failed: {str(exc).strip()}"
        if _sqlstate(exc)[:2] in _FATAL_CLASSES:
            return FatalSinkError(message, sink=self.name)
        return RetriableSinkError(message, sink=self.name)
