"""The part markers and committed positions, in the catalog's PostgreSQL schema.

``twophase_iceberg_parts`` holds one row per part of a sink: its state (open, prepared,
committed, aborted), positions, record count, and at prepare what the commit needs (the
manifest of the part's data files, the keys it deletes). ``twophase_iceberg_positions`` holds
the next offset per source partition, raised in the commit's transaction.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from twophase.participants.sdk import PartId, PartMarker, PartState

__all__ = ["Parts"]

_DDL = """
CREATE TABLE IF NOT EXISTS {parts} (
    sink text NOT NULL,
    token text NOT NULL,
    pipeline text NOT NULL,
    txn bigint NOT NULL,
    participant text NOT NULL,
    state text NOT NULL,
    positions jsonb NOT NULL DEFAULT '[]',
    records bigint NOT NULL DEFAULT 0,
    prepared jsonb,
    committed_at timestamptz,
    PRIMARY KEY (sink, token)
);
CREATE INDEX IF NOT EXISTS {parts_state} ON {parts} (sink, pipeline, state);
CREATE TABLE IF NOT EXISTS {positions} (
    sink text NOT NULL,
    pipeline text NOT NULL,
    topic text NOT NULL,
    kafka_partition int NOT NULL,
    next bigint NOT NULL,
    PRIMARY KEY (sink, pipeline, topic, kafka_partition)
)"""
_CREATE_LOCK_KEY = 0x7477_6F70_6D61_726B  # "twopmark"


class Parts:
    """SQL of the marker and position tables of one sink (``schema`` is the catalog's)."""

    def __init__(self, schema: str, sink: str) -> None:
        self.sink = sink
        self.parts = sql.Identifier(schema, "twophase_iceberg_parts")
        self.positions = sql.Identifier(schema, "twophase_iceberg_positions")

    def create(self, conn: psycopg.Connection[Any]) -> None:
        """Make the tables when missing. Tables that exist are not touched: DDL on them (even
        ``CREATE INDEX IF NOT EXISTS``) would wait for every commit in flight."""
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
            (self.parts.as_string(conn), self.positions.as_string(conn)),
        ).fetchone()
        if row is not None and row[0]:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK_KEY,))
            for ddl in _DDL.split(";"):
                conn.execute(
                    sql.SQL(ddl).format(
                        parts=self.parts,
                        parts_state=sql.Identifier("twophase_iceberg_parts_state"),
                        positions=self.positions,
                    )
                )

    def lock(self, conn: psycopg.Connection[Any], part: PartId) -> tuple[str, Any, Any] | None:
        """In ``conn``'s transaction: the part's (state, positions, prepared), its row locked."""
        row = conn.execute(
            sql.SQL(
                "SELECT state, positions, prepared FROM {} WHERE sink = %s AND token = %s"
                " FOR UPDATE"
            ).format(self.parts),
            (self.sink, part.token),
        ).fetchone()
        return None if row is None else (str(row[0]), row[1], row[2])

    def save(
        self,
        conn: psycopg.Connection[Any],
        marker: PartMarker,
        expect: Collection[PartState | None],
        positions: list[dict[str, Any]],
        prepared: dict[str, Any] | None,
    ) -> bool:
        """Compare-and-set the marker (in ``conn``'s transaction)."""
        part = marker.part
        found = self.lock(conn, part)
        if (found[0] if found else None) not in expect:
            return False
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (sink, token, pipeline, txn, participant, state, positions,"
                " records, prepared) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (sink, token) DO UPDATE SET state = EXCLUDED.state,"
                " positions = EXCLUDED.positions, records = EXCLUDED.records,"
                " prepared = EXCLUDED.prepared, committed_at = NULL"
            ).format(self.parts),
            (
                self.sink,
                part.token,
                part.pipeline,
                part.txn,
                part.participant,
                marker.state,
                Jsonb(positions),
                marker.records,
                None if prepared is None else Jsonb(prepared),
            ),
        )
        return True

    def set_state(self, conn: psycopg.Connection[Any], part: PartId, state: PartState) -> None:
        conn.execute(
            sql.SQL(
                "UPDATE {} SET state = %s, committed_at = CASE WHEN %s = 'committed'"
                " THEN now() END WHERE sink = %s AND token = %s"
            ).format(self.parts),
            (state, state, self.sink, part.token),
        )

    def raise_positions(
        self, conn: psycopg.Connection[Any], pipeline: str, positions: list[dict[str, Any]]
    ) -> None:
        if not positions:
            return
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL(
                    "INSERT INTO {} VALUES (%s, %s, %s, %s, %s) ON CONFLICT"
                    " (sink, pipeline, topic, kafka_partition) DO UPDATE"
                    " SET next = greatest({}.next, EXCLUDED.next)"
                ).format(self.positions, self.positions),
                [(self.sink, pipeline, p["topic"], p["partition"], p["offset"]) for p in positions],
            )

    def load(self, conn: psycopg.Connection[Any], part: PartId) -> tuple[str, Any, int] | None:
        row = conn.execute(
            sql.SQL(
                "SELECT state, positions, records FROM {} WHERE sink = %s AND token = %s"
            ).format(self.parts),
            (self.sink, part.token),
        ).fetchone()
        return None if row is None else (str(row[0]), row[1], int(row[2]))

    def tokens(self, conn: psycopg.Connection[Any], pipeline: str, state: str) -> list[str]:
        rows = conn.execute(
            sql.SQL("SELECT token FROM {} WHERE sink = %s AND pipeline = %s AND state = %s").format(
                self.parts
            ),
            (self.sink, pipeline, state),
        ).fetchall()
        return [str(r[0]) for r in rows]

    def all_prepared(self, conn: psycopg.Connection[Any]) -> list[Any]:
        """The ``prepared`` blobs of every prepared part of every sink in this schema: files a
        commit will reference."""
        rows = conn.execute(
            sql.SQL("SELECT prepared FROM {} WHERE state = 'prepared'").format(self.parts)
        ).fetchall()
        return [r[0] for r in rows if r[0]]

    def committed_positions(
        self, conn: psycopg.Connection[Any], pipeline: str
    ) -> dict[tuple[str, int], int]:
        rows = conn.execute(
            sql.SQL(
                "SELECT topic, kafka_partition, next FROM {} WHERE sink = %s AND pipeline = %s"
            ).format(self.positions),
            (self.sink, pipeline),
        ).fetchall()
        return {(str(t), int(p)): int(n) for t, p, n in rows}

    def last_committed(
        self, conn: psycopg.Connection[Any], pipeline: str
    ) -> tuple[int, str, datetime | None] | None:
        row = conn.execute(
            sql.SQL(
                "SELECT txn, participant, committed_at FROM {} WHERE sink = %s AND pipeline = %s"
                " AND state = 'committed' ORDER BY txn DESC, committed_at DESC NULLS LAST"
                " LIMIT 1"
            ).format(self.parts),
            (self.sink, pipeline),
        ).fetchone()
        return None if row is None else (int(row[0]), str(row[1]), row[2])

    def forget(self, conn: psycopg.Connection[Any], pipeline: str, before_txn: int) -> int:
        """Decided markers with ``txn < before_txn``, but those of the newest committed txn
        (positions live in their own table)."""
        cur = conn.execute(
            sql.SQL(
                "DELETE FROM {p} WHERE sink = %(sink)s AND pipeline = %(pipeline)s"
                " AND state IN ('committed', 'aborted') AND txn < %(before)s"
                " AND txn < coalesce((SELECT max(txn) FROM {p} WHERE sink = %(sink)s"
                " AND pipeline = %(pipeline)s AND state = 'committed'), %(before)s)"
            ).format(p=self.parts),
            {"sink": self.sink, "pipeline": pipeline, "before": before_txn},
        )
        return max(cur.rowcount, 0)
