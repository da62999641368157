"""PostgreSQL two-phase commit as the PostgreSQL sink uses it (psycopg 3 ``tpc_*``)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

pytestmark = pytest.mark.stack


def _prepared(conn: psycopg.Connection[Any], name: str) -> list[psycopg.Xid]:
    # psycopg stores XA-style xids base64-encoded in the gid, so match on the decoded gtrid.
    return [xid for xid in conn.tpc_recover() if name in xid.gtrid]


def test_server_allows_enough_prepared_transactions(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        value = conn.execute("SHOW max_prepared_transactions").fetchone()
    assert value is not None
    assert int(value[0]) >= 64


def test_prepared_transaction_survives_its_connection_and_commits_from_another(
    pg_dsn: str, unique_name: str
) -> None:
    table = sql.Identifier(unique_name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table))
    try:
        preparer = psycopg.connect(pg_dsn)
        xid = preparer.xid(1, f"{unique_name}-gtrid", "participant-0")
        preparer.tpc_begin(xid)
        preparer.execute(sql.SQL("INSERT INTO {} VALUES (1), (2)").format(table))
        preparer.tpc_prepare()
        preparer.close()  # The "crash": the prepared transaction must outlive its session.

        with psycopg.connect(pg_dsn, autocommit=True) as observer:
            count = observer.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
            assert count == (0,), "prepared rows must not be visible before COMMIT PREPARED"

        recoverer = psycopg.connect(pg_dsn)
        try:
            found = _prepared(recoverer, unique_name)
            assert [x.gtrid for x in found] == [f"{unique_name}-gtrid"]
            assert (found[0].format_id, found[0].bqual) == (1, "participant-0")
            recoverer.tpc_commit(found[0])
        finally:
            recoverer.close()

        with psycopg.connect(pg_dsn, autocommit=True) as observer:
            rows = observer.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(table))
            assert rows.fetchall() == [(1,), (2,)]
            assert not _prepared(observer, unique_name), "nothing prepared may be left behind"
    finally:
        with psycopg.connect(pg_dsn) as conn:
            # A failed run must not leave a prepared transaction holding locks on the table.
            for xid in _prepared(conn, unique_name):
                conn.tpc_rollback(xid)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
