"""Read a Spark pipeline's sinks directly and check them against the ids that were sent.

Like :func:`harness.verify`, this never trusts the product's bookkeeping: it counts rows
in the stores, prepared transactions in ``pg_prepared_xacts``, staged documents and files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from twophase.config import PipelineConfig
from twophase.participants.spark import virtual_topic

__all__ = ["SinkCheck", "check_sinks", "checks_json"]


@dataclass(frozen=True, slots=True)
class SinkCheck:
    rows: int
    distinct: int
    duplicated: int
    missing: int
    unexpected: int
    prepared: int
    staged: int

    @property
    def ok(self) -> bool:
        return not (
            self.duplicated or self.missing or self.unexpected or self.prepared or self.staged
        )


def _check(ids: list[int], expected: set[int], prepared: int, staged: int) -> SinkCheck:
    seen: dict[int, int] = {}
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
    return SinkCheck(
        rows=len(ids),
        distinct=len(seen),
        duplicated=sum(c - 1 for c in seen.values() if c > 1),
        missing=len(expected - set(seen)),
        unexpected=len(set(seen) - expected),
        prepared=prepared,
        staged=staged,
    )


def _postgres(cfg: PipelineConfig, sink: dict[str, Any], expected: set[int]) -> SinkCheck:
    import psycopg
    from psycopg import sql

    with psycopg.connect(str(sink["dsn"]), autocommit=True) as conn:
        table = sql.Identifier(*str(sink["table"]).split("."))
        ids = [int(r[0]) for r in conn.execute(sql.SQL("SELECT id FROM {}").format(table))]
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s",
            (f"twophase:{sink['name']}:{cfg.pipeline}~%",),
        ).fetchone()
    return _check(ids, expected, int(row[0]) if row else 0, 0)


def _mongodb(cfg: PipelineConfig, sink: dict[str, Any], expected: set[int]) -> SinkCheck:
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(str(sink["uri"]))
    try:
        db = client[str(sink["database"])]
        collection = str(sink["collection"])
        ids = [int(d["id"]) for d in db[collection].find({}, {"id": 1, "_id": 0})]
        staging = str(sink.get("staging_collection") or f"{collection}__twophase_staging")
        prefix = f"^{sink['name']}:{cfg.pipeline}~"
        staged = db[staging].count_documents({"part": {"$regex": prefix}})
        markers = db[str(sink.get("marker_collection") or "twophase_parts")]
        prepared = markers.count_documents(
            {"pipeline": cfg.pipeline, "sink": sink["name"], "state": {"$in": ["prepared", "open"]}}
        )
    finally:
        client.close()
    return _check(ids, expected, prepared, staged)


def _files(cfg: PipelineConfig, sink: dict[str, Any], expected: set[int]) -> SinkCheck:
    import pyarrow.dataset as ds

    base = Path(str(sink["path"]))
    data = base / virtual_topic(cfg.pipeline)
    fmt = "json" if sink.get("format") == "jsonl" else "parquet"
    ids: list[int] = []
    if data.exists():
        table = ds.dataset(str(data), format=fmt, partitioning="hive").to_table(columns=["id"])
        ids = [int(i) for i in table.column("id").to_pylist()]
    book = base / "_twophase" / cfg.pipeline
    prepared = len(list((book / "prepared").glob("*"))) if (book / "prepared").exists() else 0
    staged = len(list((book / "open").glob("*"))) if (book / "open").exists() else 0
    return _check(ids, expected, prepared, staged)


_READERS = {"postgres": _postgres, "mongodb": _mongodb, "files": _files}


def check_sinks(cfg: PipelineConfig, expected: set[int]) -> dict[str, SinkCheck]:
    """Per sink name: every expected ``id`` exactly once, nothing else, nothing left prepared."""
    return {
        str(s["name"]): _READERS[str(s["type"])](cfg, s, expected)
        for s in cfg.sinks
        if str(s["type"]) in _READERS
    }


def checks_json(checks: dict[str, SinkCheck]) -> str:
    return json.dumps({k: asdict(v) | {"ok": v.ok} for k, v in checks.items()}, indent=2)
