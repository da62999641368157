"""The one fixture the conformance kit needs: how to build this sink, and how to read its store."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from twophase_sqlite import SqliteSink

from twophase.participants.sdk.testkit import SinkFactory


@pytest.fixture
def twophase_sink_factory(tmp_path: Path) -> SinkFactory:
    path = tmp_path / "store.db"

    def committed_ids() -> list[str]:
        """What a reader of the target table sees (a plain connection, no sink code)."""
        with closing(sqlite3.connect(path)) as db:
            return [row[0] for row in db.execute('SELECT id FROM "orders"')]

    return SinkFactory(
        sink_class=SqliteSink,
        config={
            "name": "orders-db",
            "type": "sqlite",
            "path": str(path),
            "table": "orders",
            "columns": {"id": "TEXT NOT NULL", "n": "INTEGER CHECK (n >= 0)", "text": "TEXT"},
        },
        committed_ids=committed_ids,
        bad_value={"id": "refused", "n": -1, "text": "the CHECK refuses a negative n"},
    )
