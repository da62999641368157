"""Pipeline throughput on the local stack: real ``twophase`` processes, timed from the outside.

One source topic holds the records for every run (produced once); each run is a new pipeline
(new consumer group, new table, new directory) that reads it from the start. A run's rate is
taken from the source group's committed offsets, polled every 0.1 s -- the offsets the
coordinator commits with each decision (exactly-once) or the participant after each batch
(at-least-once), i.e. records that are durably in every sink:

    records_per_s = (records - c10) / (t(100 % committed) - t10)

t10 is the first poll that sees at least 10 % committed, c10 what it saw. The first 10 % are
left out so process start-up and the group join (the same for every mode,
and not a throughput property) do not count; the tail is in. Every run is then checked in the
stores: PostgreSQL rows counted, Parquet rows counted from the files' footers.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from twophase.config import load_config
from twophase.harness import Cluster, Scenario, control_summary, produce
from twophase.kafka import create_topics

#: Participants per pipeline run: one per core of the reference machine.
PARTICIPANTS = 2
PARTITIONS = 4
POLL_S = 0.1


@dataclass
class Source:
    bootstrap: str
    topic: str
    records: int
    partitions: int = PARTITIONS

    @classmethod
    def create(cls, bootstrap: str, records: int, tag: str, partitions: int = PARTITIONS) -> Source:
        topic = f"bench-{tag}-{uuid.uuid4().hex[:6]}.orders"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[
            topic
        ].result()
        if records:
            produce(bootstrap, topic, 0, records)
        return cls(bootstrap, topic, records, partitions)

    def delete(self) -> None:
        AdminClient({"bootstrap.servers": self.bootstrap}).delete_topics([self.topic])


@dataclass
class RunResult:
    mode: str
    sinks: list[str]
    records: int
    records_per_s: float
    seconds: float
    wall_s: float
    verified: dict[str, int] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)

    def asdict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "sinks": self.sinks,
            "records": self.records,
            "records_per_s": round(self.records_per_s),
            "seconds_10_to_100_pct": round(self.seconds, 2),
            "wall_s": round(self.wall_s, 2),
            "verified_rows": self.verified,
            **({"control": self.control} if self.control else {}),
        }


class CommittedProbe:
    """Sum of a group's committed offsets over the source partitions."""

    def __init__(self, source: Source, group: str) -> None:
        self.tps = [TopicPartition(source.topic, p) for p in range(source.partitions)]
        self.c = Consumer({"bootstrap.servers": source.bootstrap, "group.id": group})

    def total(self) -> int:
        got = self.c.committed(self.tps, timeout=10)
        return sum(max(tp.offset, 0) for tp in got)

    def close(self) -> None:
        self.c.close()


def scenario(name: str, workdir: Path, source: Source, *, sinks: set[str], mode: str) -> Scenario:
    s = Scenario.on_stack(
        name,
        workdir,
        partitions=source.partitions,
        mongo="mongo" in sinks,
        files="files" in sinks,
        extra={
            "sources": [
                {"topic": source.topic, "partitions": source.partitions, "replication_factor": 1}
            ],
            "participant": {"mode": mode},
        },
    )
    if "pg" not in sinks:
        cfg = s.config()
        cfg["sinks"] = [x for x in cfg["sinks"] if x["name"] != "pg"]
        s.extra["sinks"] = cfg["sinks"]
    return s


@contextlib.contextmanager
def running(s: Scenario, mode: str, participants: int) -> Iterator[Cluster]:
    cluster = Cluster(s)
    try:
        if mode == "exactly_once":
            cluster.start("coordinator", "coord-0")
        for i in range(participants):
            cluster.start("participant", f"worker-{i}")
        yield cluster
    finally:
        cluster.stop_all()


def pipeline_run(
    source: Source,
    workdir: Path,
    *,
    mode: str,
    sinks: set[str],
    participants: int = PARTICIPANTS,
    timeout_s: float = 900.0,
) -> RunResult:
    name = f"bench-{mode.split('_')[0]}-{uuid.uuid4().hex[:6]}"
    s = scenario(name, workdir / name, source, sinks=sinks, mode=mode)
    create_topics(load_config(s.write()))
    if "pg" in sinks:
        s.prepare_stores()
    if "mongo" in sinks:
        _drop_mongo(s)
    probe = CommittedProbe(source, f"twophase.{name}")
    n = source.records
    t10 = t100 = 0.0
    at10 = 0
    started = time.monotonic()
    try:
        with running(s, mode, participants) as cluster:
            deadline = started + timeout_s
            while time.monotonic() < deadline:
                done = probe.total()
                now = time.monotonic()
                if not t10 and done >= n // 10:
                    t10, at10 = now, done
                if done >= n:
                    t100 = now
                    break
                for proc_name in cluster.procs:
                    if not cluster.alive(proc_name):
                        raise RuntimeError(f"{proc_name} exited:\n{cluster.log_tail(proc_name)}")
                time.sleep(POLL_S)
            else:
                raise TimeoutError(f"{name}: {probe.total()} of {n} committed in {timeout_s}s")
    finally:
        probe.close()
    wall = time.monotonic() - started
    verified = _verify(s, sinks, source.topic)
    exact = mode == "exactly_once"
    for sink, rows in verified.items():
        if rows < n or (exact and rows != n):
            raise RuntimeError(f"{name}: sink {sink} holds {rows} rows of {n}")
    control = control_summary(s) if exact else {}
    _cleanup(s, sinks)
    return RunResult(
        mode, sorted(sinks), n, (n - at10) / (t100 - t10), t100 - t10, wall, verified, control
    )


def _verify(s: Scenario, sinks: set[str], topic: str) -> dict[str, int]:
    out: dict[str, int] = {}
    if "pg" in sinks:
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {s.table}").fetchone()
            out["pg"] = int(row[0]) if row else 0
    if "files" in sinks:
        import pyarrow.parquet as pq

        out["files"] = sum(
            pq.ParquetFile(f).metadata.num_rows for f in (s.files_path / topic).rglob("*.parquet")
        )
    if "mongo" in sinks:
        from pymongo import MongoClient

        client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
        out["mongo"] = client[s.table]["orders"].estimated_document_count()
        client.close()
    return out


def _drop_mongo(s: Scenario) -> None:
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
    client.drop_database(s.table)
    client.close()


def _cleanup(s: Scenario, sinks: set[str]) -> None:
    if "pg" in sinks:
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {s.table}")
    if "mongo" in sinks:
        _drop_mongo(s)
    shutil.rmtree(s.workdir, ignore_errors=True)


# -- the ceilings: the same rows written straight into the store, no Kafka, no twophase -------

COLUMNS = ("id", "customer", "amount", "currency", "ts", "note")


def source_rows(source: Source) -> list[dict[str, Any]]:
    """The source topic's values, decoded once (not timed)."""
    c = Consumer(
        {
            "bootstrap.servers": source.bootstrap,
            "group.id": f"bench-reader-{uuid.uuid4().hex[:6]}",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    c.assign([TopicPartition(source.topic, p, 0) for p in range(source.partitions)])
    rows: list[dict[str, Any]] = []
    eof = 0
    while eof < source.partitions:
        for m in c.consume(10_000, 1.0):
            if m.error() is not None:
                eof += 1
            else:
                rows.append(orjson.loads(m.value() or b"{}"))
    c.close()
    if len(rows) != source.records:
        raise RuntimeError(f"read {len(rows)} of {source.records} source records")
    return rows


def pg_copy_run(dsn: str, rows: list[dict[str, Any]], batch: int = 50_000) -> float:
    """psycopg ``COPY ... FROM STDIN`` of the rows, one committed transaction per batch, into
    a table like the pipeline's: records per second."""
    table = f"bench_copy_{uuid.uuid4().hex[:6]}"
    tuples = [tuple(r[c] for c in COLUMNS) for r in rows]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigint NOT NULL, customer text, "
            "amount numeric(12,2), currency text, ts timestamptz, note text)"
        )
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        for i in range(0, len(tuples), batch):
            with (
                conn.cursor() as cur,
                cur.copy(f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN") as copy,
            ):
                for t in tuples[i : i + batch]:
                    copy.write_row(t)
            conn.commit()
    took = time.monotonic() - started
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        conn.execute(f"DROP TABLE {table}")
    if not row or row[0] != len(rows):
        raise RuntimeError(f"COPY wrote {row} rows of {len(rows)}")
    return len(rows) / took


def mongo_direct_run(uri: str, rows: list[dict[str, Any]], batch: int = 1000) -> float:
    """pymongo ``insert_many`` of the same documents, unordered, in batches: documents/s."""
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    db = client[f"bench_direct_{uuid.uuid4().hex[:6]}"]
    docs = [dict(r) for r in rows]
    started = time.monotonic()
    for i in range(0, len(docs), batch):
        db["orders"].insert_many(docs[i : i + batch], ordered=False)
    took = time.monotonic() - started
    got = db["orders"].count_documents({})
    client.drop_database(db.name)
    client.close()
    if got != len(rows):
        raise RuntimeError(f"insert_many wrote {got} documents of {len(rows)}")
    return len(rows) / took
